"""Fronts of the native engine.

`LLM`: offline, for tests and benchmarks: `LLM(model_dir).generate(prompts, SamplingParams(...))`.
`AsyncLLM`: the serving front (the `AsyncEngine` interface): the step loop runs in its own
thread; `add()` streams deltas into the caller's event loop; abort frees the cache.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from backend.engine.args import EngineArgs
from backend.engine.engine import LLMEngine
from backend.engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger("deepseek.engine")


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None


class LLM:
    def __init__(self, model: str = "", **engine_args):
        self.engine = LLMEngine(EngineArgs.from_dict({"model": model, **engine_args}))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams | list[SamplingParams]
                 ) -> list[Completion]:
        """Run every prompt to completion together (continuous batching); results in order."""
        sampling = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids, done = [], {}
        for prompt, p in zip(prompts, sampling):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            req = GenerationRequest(rid, prompt=prompt, sampling=p) if isinstance(prompt, str) else \
                GenerationRequest(rid, prompt_token_ids=list(prompt), sampling=p)
            seq = self.engine.add_request(req)
            ids.append((rid, seq))
            done[rid] = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done[out.request_id].append(out)
        results = []
        for rid, seq in ids:
            outs = done[rid]
            logprobs = [lp for o in outs for lp in (o.logprobs or [])] if seq.sampling.logprobs is not None else None
            results.append(Completion(rid, seq.prompt_token_ids, list(seq.output_token_ids),
                                      "".join(o.text for o in outs), seq.finish_reason,
                                      seq.cumulative_logprob, logprobs))
        return results


class AsyncLLM:
    """The native engine behind the async interface the Triton backend uses."""

    def __init__(self, engine_args: dict | EngineArgs):
        self.args = engine_args if isinstance(engine_args, EngineArgs) else EngineArgs.from_dict(dict(engine_args))
        self.engine: LLMEngine | None = None
        self.tokenizer = None
        self._cmds: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = False
        self._dead: str | None = None

    async def start(self) -> None:
        self.engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, self.args)
        self.tokenizer = self.engine.tokenizer
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()
        self._accepting = True

    # --- the interface ------------------------------------------------------------------------

    async def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDead(f"engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDead("engine is not accepting requests (starting or shutting down)")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        self._cmds.put(("add", request, loop, stream, admitted))
        self._wake.set()
        await admitted  # InvalidRequest / EngineOverloaded surface here, before any delta
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (cancelled, disconnected): free the cache
                self._cmds.put(("abort", request.request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        if self.engine is None:
            return {}
        return self.engine.stats()

    def health(self) -> bool:
        return self.engine is not None and self._dead is None and self._thread is not None and self._thread.is_alive()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._cmds.put(("abort_all",))
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    # --- the step thread ----------------------------------------------------------------------

    def _send(self, request_id: str, item, done: bool = False) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        if done:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _handle(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, request, loop, stream, admitted = cmd
            try:
                if eng.num_waiting >= self.args.max_waiting_requests:
                    raise EngineOverloaded(f"{eng.num_waiting} requests waiting (max_waiting_requests="
                                           f"{self.args.max_waiting_requests}); retry later")
                eng.add_request(request)
            except (InvalidRequest, EngineOverloaded) as e:
                loop.call_soon_threadsafe(lambda err=e: admitted.done() or admitted.set_exception(err))
                return
            self._streams[request.request_id] = (loop, stream)
            loop.call_soon_threadsafe(lambda: admitted.done() or admitted.set_result(True))
        elif cmd[0] == "abort":
            out = eng.abort(cmd[1])
            if out is not None:
                self._send(cmd[1], out, done=True)
        elif cmd[0] == "abort_all":
            for rid in list(eng.requests):
                out = eng.abort(rid)
                if out is not None:
                    self._send(rid, out, done=True)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            while True:
                try:
                    self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    break
            if not eng.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._fail_in_flight(e)
                continue
            for out in outputs:
                self._send(out.request_id, out, done=out.finished)

    def _fail_in_flight(self, exc: Exception) -> None:
        fatal = "CUDA" in str(exc) or isinstance(exc, MemoryError)
        for seq in list(self.engine.scheduler.running):
            self.engine.abort(seq.request_id)
            self._send(seq.request_id, RequestFailed(f"engine step failed: {exc!r}"), done=True)
        if fatal:
            self._dead = repr(exc)
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
                self._send(rid, EngineDead(f"engine stopped: {exc!r}"), done=True)
            self._stop = True
