"""OpenAI's error body, and the HTTP status each Triton error code stands for."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error the API answers with: `status`, and OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}  # e.g. Retry-After on an overload

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_triton(message: str) -> OpenAIError:
    """The model's messages start with their Triton code (backend/model.py says why); gRPC-level
    failures (Triton down, model not loaded) come as tritonclient's text."""
    if message.startswith("INVALID_ARG"):
        return OpenAIError(400, message)
    if message.startswith("UNAVAILABLE: engine overloaded"):
        return OpenAIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")
    if message.startswith("UNAVAILABLE") or "StatusCode.UNAVAILABLE" in message:
        return OpenAIError(503, message, type="service_unavailable", code="service_unavailable")
    if "unknown model" in message.lower() or "is not ready" in message:
        return OpenAIError(503, message, type="service_unavailable", code="model_not_ready")
    return OpenAIError(500, message, type="internal_error", code="internal_error")
