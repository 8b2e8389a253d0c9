"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Handlers raise `APIError`; the app turns it into the JSON body. SamplingParams and the engine raise
ValueErrors whose message starts with the field name; `param_of_value_error` maps that name back to
the request parameter the client sent, so a 400 names what the client must change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    """An error the client gets back as ``{"error": {...}}`` with ``status_code``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, param=None, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="kvreuse"'})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", param="model", code="model_not_found")


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, error_type="server_error", code=code,
                    headers={"Retry-After": str(retry_after_s)})


def internal_error(message: str) -> APIError:
    return APIError(500, message, error_type="server_error", code="internal_error")


# A field name, optionally followed by an index path: "top_p", "messages[2].content[0]".
_LEADING_PATH = re.compile(r"^([a-z_]+)((?:\[\d+\]|\.[a-z_]+)*)")
# One-word fields: any other leading word ("the prompt ...", "a prompt ...") is prose, not a name.
_SINGLE_WORD_FIELDS = frozenset({"n", "temperature", "seed", "stop", "logprobs", "prompt", "messages", "model", "tokens"})


def param_of_value_error(message: str, renames: Mapping[str, str] | None = None) -> str | None:
    """The request parameter a ValueError message is about: its leading field name or path
    (``"top_p must be in (0, 1]..."`` -> ``"top_p"``, ``"messages[1].role must..."`` ->
    ``"messages[1].role"``), with a bare name renamed through ``renames`` (e.g.
    ``{"logprobs": "top_logprobs"}`` for chat)."""
    match = _LEADING_PATH.match(message)
    if match is None:
        return None
    name, path = match.group(1), match.group(2)
    if path:
        return name + path
    if renames and name in renames:
        return renames[name]
    if "_" in name or name in _SINGLE_WORD_FIELDS:
        return name
    return None
