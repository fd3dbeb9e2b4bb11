"""Closed-loop users calling the engine's async interface directly (AsyncLLM, or CoreClient with the
core in its own process): the load a loadtest.sweep level puts through a server, with no server.
tools.bench_engine's `--duration` mode runs it and reads the records with loadtest.window, as the
sweep reads its own, so engine-direct and served rates share one accounting.

Every user sends its next prompt when its last request ends, from the start until `duration_s`
has passed ("stopping"); requests still in flight then get `stop_timeout_s` to finish, and the rest
are cancelled (the engine aborts them and frees their cache) and recorded `cancelled` with what
they streamed, as the sweep's drivers record the users they stop mid-stream.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from client.types import Delta
from engine.request import GenerationRequest, SamplingParams
from loadtest.measure import ERROR_BACKOFF_S, Measure
from loadtest.workloads import Request


@dataclass
class Level:
    """What one level recorded: request records (loadtest.measure's, with "user"), the window marks
    in wall-clock seconds ("start", "stopping", "stop", and "cpu" when this process's CPU counts),
    and the prompt tokens the engine found in its prefix cache."""

    requests: list[dict] = field(default_factory=list)
    marks: dict = field(default_factory=dict)
    cached_tokens: int = 0


async def _request(engine, rid: str, prompt: list[int], output_len: int, m: Measure, level: Level) -> None:
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    async for out in engine.add(GenerationRequest(rid, prompt_token_ids=prompt, sampling=sp)):
        m.add(Delta(out.text, num_output_tokens=len(out.token_ids), num_input_tokens=out.num_prompt_tokens or None,
                    finish_reason=out.finish_reason))
        if out.finished:
            if out.finish_reason == "error":
                raise RuntimeError(out.error or "the engine failed the request")
            level.cached_tokens += out.num_cached_tokens


async def closed_loop(engine, users: int, prompts: Callable[[int], Iterator[list[int]]], output_len: int,
                      duration_s: float, stop_timeout_s: float, tag: str, client_cpu: bool = False) -> Level:
    """`users` closed-loop users for `duration_s`; user u sends the prompts of `prompts(u)` in order.
    client_cpu: this process is only the clients and the front (the core runs elsewhere), so its CPU
    over the run is recorded for loadtest.saturation."""
    level = Level()
    stopping = asyncio.Event()

    async def user(u: int) -> None:
        source = prompts(u)
        for n in itertools.count():
            if stopping.is_set():
                return
            prompt = next(source)
            request = Request("", output_len, len(prompt), session=f"u{u}", turn=n)
            m, error = Measure(), None
            try:
                await _request(engine, f"{tag}-{u}-{n}", prompt, output_len, m, level)
            except asyncio.CancelledError:  # stopped past the stop timeout: what it streamed still counts
                level.requests.append({"user": u, **m.record(request, None, cancelled=True)})
                raise
            except Exception as e:  # noqa: BLE001 - a failed request is data; the user carries on
                error = e
            level.requests.append({"user": u, **m.record(request, error, cancelled=False)})
            if error is not None:
                await asyncio.sleep(ERROR_BACKOFF_S)

    wall0, cpu0 = time.time(), time.process_time()
    level.marks["start"] = wall0
    tasks = [asyncio.create_task(user(u)) for u in range(users)]
    await asyncio.sleep(duration_s)
    level.marks["stopping"] = now = time.time()
    if client_cpu:
        level.marks["cpu"] = [{"pid": os.getpid(), "cpu_s": time.process_time() - cpu0, "wall_s": now - wall0}]
    stopping.set()
    _, late = await asyncio.wait(tasks, timeout=stop_timeout_s) if stop_timeout_s > 0 else (set(), set(tasks))
    for t in late:
        t.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
    level.marks["stop"] = time.time()
    return level
