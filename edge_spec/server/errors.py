"""Errors a request ends with, in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class ApiError(Exception):
    """An HTTP error response; ``headers`` go with it (``Retry-After`` on 429)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
