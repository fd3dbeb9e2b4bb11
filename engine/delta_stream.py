"""A request's deltas as its consumer reads them, for both serving fronts (AsyncLLM and the
engine core's client): deltas that piled up behind a slow consumer go out merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.request import RequestOutput, merge_outputs


async def merged_deltas(stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """Yield `stream`'s RequestOutputs until the finished one; an exception in the stream is
    raised (after the deltas before it). A consumer that fell behind (150 streams in one event
    loop) takes what has piled up as one delta: its per-delta work then scales with requests,
    not tokens."""
    while True:
        items = [await stream.get()]
        while isinstance(items[-1], RequestOutput) and not items[-1].finished and not stream.empty():
            items.append(stream.get_nowait())
        error = items.pop() if isinstance(items[-1], Exception) else None
        finished = False
        if items:
            out = merge_outputs(items)
            finished = out.finished
            yield out
        if error is not None:
            raise error
        if finished:
            return


def on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on a consumer's event loop, from another thread (a step loop, a watchdog)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed
        pass
