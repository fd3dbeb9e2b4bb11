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


RETRY_AFTER_S = 1  # the Retry-After of every "come back later" answer (admission's too)


def retry_later(status: int, message: str, type: str, code: str) -> OpenAIError:
    """A refusal the same request may succeed after (overloaded, not ready): Retry-After says so."""
    return OpenAIError(status, message, type=type, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def from_triton(message: str) -> OpenAIError:
    """The model's messages start with their Triton code (backend/model.py says why); gRPC-level
    failures (Triton down, model not loaded) come as tritonclient's text."""
    if message.startswith("INVALID_ARG"):
        return OpenAIError(400, message)
    if message.startswith("UNAVAILABLE: engine overloaded"):
        return retry_later(429, message, "rate_limit_error", "rate_limit_exceeded")
    if message.startswith("UNAVAILABLE") or "StatusCode.UNAVAILABLE" in message:
        return retry_later(503, message, "service_unavailable", "service_unavailable")
    if "unknown model" in message.lower() or "is not ready" in message:
        return retry_later(503, message, "service_unavailable", "model_not_ready")
    return OpenAIError(500, message, type="internal_error", code="internal_error")
