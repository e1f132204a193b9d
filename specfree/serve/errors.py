"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """A request the server answers with ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error" if status < 500
                                                                   else "server_error"),
                      "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)
