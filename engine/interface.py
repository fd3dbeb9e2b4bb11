"""The async engine interface both engines implement (native: engine/llm.py and, its core in a
process of its own, engine/core_client.py; vllm: backend/vllm_engine.py). The Triton backend talks
to nothing else."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from engine.request import GenerationRequest, RequestFailed, RequestOutput


class DeltaSink(Protocol):
    """Where the deltas of a request started with `submit` go, on the thread that delivers them."""

    def output(self, out: RequestOutput) -> None:
        """A delta; the last one has finished=True."""

    def failed(self, error: BaseException) -> None:
        """The request ended with `error` instead of a finished delta: InvalidRequest, EngineOverloaded,
        EngineDead, RequestFailed, asyncio.CancelledError (the caller's loop is shutting down), or a bug."""


class AsyncEngine(Protocol):
    async def start(self) -> None:
        """Load the model and start stepping. Raises on a bad configuration."""

    def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit a request and stream its deltas; the last one has finished=True.
        Raises InvalidRequest (client's mistake) or EngineOverloaded before the first delta."""

    def submit(self, request: GenerationRequest, sink: DeltaSink, loop: asyncio.AbstractEventLoop) -> None:
        """`add` for a caller on another thread than the engine's loop (the Triton model's execute
        thread): returns at once, and the request's deltas, or its failure, go to `sink`. `loop`: the
        caller's event loop, where an engine that only has `add` runs it (SubmitThroughAdd); the core
        client hands each delta to the sink on its reader thread, with no event loop between."""

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


class SubmitThroughAdd:
    """`submit` for an engine that delivers through `add` only: the request's async iteration runs
    on the caller's event loop, and each delta goes to the sink there."""

    def submit(self, request: GenerationRequest, sink: DeltaSink, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.run_coroutine_threadsafe(pump(self.add(request), sink), loop)


async def pump(deltas: AsyncIterator[RequestOutput], sink: DeltaSink) -> None:
    """Every delta of `deltas` to `sink`, or how the stream failed."""
    last = None
    try:
        async for out in deltas:
            last = out
            sink.output(out)
    except asyncio.CancelledError as e:
        sink.failed(e)
        raise
    except Exception as e:  # noqa: BLE001 - the sink maps it to the caller's error
        sink.failed(e)
        return
    if last is None or not last.finished:
        sink.failed(RequestFailed("the engine ended the request without a final output"))
