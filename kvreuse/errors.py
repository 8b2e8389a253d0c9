"""Typed errors for bad input, shared by the library, the HTTP APIs and the router.

`InvalidRequestError` is a ValueError (so ``except ValueError`` keeps working) that carries the
request field it is about (``param``, e.g. ``"top_p"`` or ``"messages[2].role"``) and an optional
machine-readable ``code`` (e.g. ``"context_length_exceeded"``). The server maps it to a 400 in
OpenAI's shape from these attributes, never by reading the message.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input from the caller: ``param`` names the field, the message names the limit."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
