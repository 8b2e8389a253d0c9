"""What a client gets back when a request fails, for both APIs: one mapping (`api_error_of`), two shapes.

Handlers raise `APIError`. SamplingParams, the input module, the message and tool checks, the grammar
compiler and the engine raise `kvreuse.errors.InvalidRequestError` for the request's mistakes, whose
``param`` and ``code`` become the 400's fields as they are (no message is parsed), so a 400 names what the
client must change. Anything else a handler lets out, a plain ValueError from inside the engine included,
is the server's fault: a 500 that names only the exception's type, logged with its traceback.

The shapes: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (`APIError.body`, every route
but one) and Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (`APIError.anthropic_body`,
``POST /v1/messages``), whose message starts with the field and, as kvreuse's extension, whose ``param``
holds it where one is known.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvreuse.errors import InvalidRequestError

logger = logging.getLogger("kvreuse.server")

# Anthropic's error type for each status; any other status is an "api_error".
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


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
        """OpenAI's shape."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape. Its error has no field for the parameter: the message names it up front (as
        clients of this API read it), and ``param`` carries it as well where one is known."""
        named = self.param is None or self.message.startswith(self.param)
        error: dict[str, Any] = {"type": ANTHROPIC_ERROR_TYPES.get(self.status_code, "api_error"),
                                 "message": self.message if named else f"{self.param}: {self.message}"}
        if self.param is not None:
            error["param"] = self.param
        return {"type": "error", "error": error}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, param=None, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="kvreuse"'})


def forbidden(message: str) -> APIError:
    return APIError(403, message, error_type="permission_error", code="admin_key_required")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", param="model", code="model_not_found")


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, error_type="server_error", code=code,
                    headers={"Retry-After": str(retry_after_s)})


def internal_error(message: str) -> APIError:
    return APIError(500, message, error_type="server_error", code="internal_error")


def api_error_of(error: Exception) -> APIError:
    """What the client gets for an exception a handler raised, whichever API it came through: an `APIError` as
    it is; the request's own mistake (`InvalidRequestError`, which names the field) a 400 with its ``param``
    and ``code``; anything else a 500, logged here with its traceback. A ValueError that is not an
    InvalidRequestError is not read as the client's mistake: validation raises the class, so a plain one
    comes from a fault inside the server or the engine, and its message is not the client's to see."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return bad_request(error.message, error.param, error.code)
    logger.error("unexpected error while handling a request", exc_info=error)
    return internal_error(f"internal error: {type(error).__name__}")

