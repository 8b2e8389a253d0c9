"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Handlers raise `APIError`; the app turns it into the JSON body. SamplingParams, the input module and
the engine raise `kvreuse.errors.InvalidRequestError`, whose ``param`` and ``code`` become the 400's
fields as they are (no message is parsed), so a 400 names what the client must change.
"""

from __future__ import annotations

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


def forbidden(message: str) -> APIError:
    return APIError(403, message, error_type="permission_error", code="admin_key_required")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", param="model", code="model_not_found")


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, error_type="server_error", code=code,
                    headers={"Retry-After": str(retry_after_s)})


def internal_error(message: str) -> APIError:
    return APIError(500, message, error_type="server_error", code="internal_error")
