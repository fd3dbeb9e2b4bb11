"""What the front takes on at once: requests in progress, and request-body bytes held.

Past either bound a request is refused at once with 503 and Retry-After (vLLM's and OpenAI's
overload answer), never queued: a queue here would only hold memory the bounds exist to cap,
and a client that retries after a second lands on a server with room. 16 parallel 16 MiB bodies
once took the unbounded front to 1.39 GB.

`Admission` is plain ASGI, not Starlette's HTTP middleware, which would hide a client's
disconnect from the routes (backend/openai/app.py's require_key says why)."""

from __future__ import annotations

import contextlib
import json

from backend.openai.errors import OpenAIError, retry_later

MAX_CONCURRENT_REQUESTS = 1024  # requests in progress (a stream counts until its last chunk)
MAX_BODY_BYTES_IN_FLIGHT = 64 << 20  # body bytes being read or parsed, over all requests


def overloaded(message: str) -> OpenAIError:
    return retry_later(503, message, "service_unavailable", "server_overloaded")


class Admission:
    """ASGI middleware: at most `max_concurrent` requests in progress on the guarded routes (every
    route but the probes in `open_paths`); the rest get 503 with Retry-After before the app sees them."""

    def __init__(self, app, max_concurrent: int, open_paths: frozenset[str]):
        self.app, self.max_concurrent, self.open_paths = app, max_concurrent, open_paths
        self.in_progress = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if self.in_progress >= self.max_concurrent:
            error = overloaded(f"{self.in_progress} requests in progress, at most {self.max_concurrent} "
                               "(--openai-max-concurrent-requests); retry later")
            return await _send_error(send, error)
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


async def _send_error(send, error: OpenAIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyBudget:
    """Request-body bytes held at once (read, or being parsed) over all requests. One event loop
    touches it, so a plain counter is enough."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.held = max_bytes, 0

    @contextlib.contextmanager
    def hold(self):
        """A holder whose `take(n)` adds n bytes (503 past the budget); all are given back at exit."""
        holder = _Holder(self)
        try:
            yield holder
        finally:
            self.held -= holder.taken

    def _take(self, holder: _Holder, n: int) -> None:
        if self.held + n > self.max_bytes:
            raise overloaded(f"request bodies in progress hold {self.held} bytes; this one needs {holder.taken + n}, "
                             f"at most {self.max_bytes} at once (--openai-max-body-bytes-in-flight); retry later")
        self.held += n
        holder.taken += n


class _Holder:
    def __init__(self, budget: BodyBudget):
        self.budget, self.taken = budget, 0

    def take(self, n: int) -> None:
        self.budget._take(self, n)

    def reserve(self, total: int) -> None:
        """Take up to `total` bytes now (a declared Content-Length), so later chunks need nothing more."""
        if total > self.taken:
            self.take(total - self.taken)
