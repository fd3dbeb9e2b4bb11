"""The async engine interface both engines implement (native: engine/llm.py,
vllm: backend/vllm_engine.py). The Triton backend talks to nothing else."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from engine.request import GenerationRequest, RequestOutput


class AsyncEngine(Protocol):
    async def start(self) -> None:
        """Load the model and start stepping. Raises on a bad configuration."""

    def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit a request and stream its deltas; the last one has finished=True.
        Raises InvalidRequest (client's mistake) or EngineOverloaded before the first delta."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its cache; its stream ends with finish_reason="abort"."""

    def stats(self) -> dict:
        """running, waiting, kv usage per pool, token counters, prefix-cache counters, and
        step_running_s (how long the step now running has run: readiness turns false past a few s)."""

    def health(self) -> bool:
        """False once the engine cannot serve (fatal error, shut down)."""

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop admission, let in-flight requests finish up to the timeout, then stop."""


def step_running_s(since: float | None) -> float:
    """Seconds since `since` (time.monotonic() when the running step began; None or 0: idle)."""
    return max(0.0, time.monotonic() - since) if since else 0.0


class EngineLifetime:
    """`async with AsyncLLM(args) as engine:` starts the engine and shuts it down on the way out
    (for AsyncLLM and CoreClient: tests and tools use this instead of their own try/finally)."""

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()
