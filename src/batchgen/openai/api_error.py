"""APIError: an HTTP error in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from http import HTTPStatus

# OpenAI's error types by status (what its own API answers; the openai client maps the status, not the type).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An answer other than 200: `param` names the request field at fault, `code` a machine-readable kind."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def body(self) -> dict:
        kind = _TYPES.get(self.status) or HTTPStatus(self.status).phrase.lower().replace(" ", "_")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)
