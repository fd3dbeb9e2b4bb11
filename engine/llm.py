"""Fronts of the native engine.

`LLM`: offline, for tests and benchmarks: `LLM(model_dir).generate(prompts, SamplingParams(...))`.
`AsyncLLM`: the serving front (the `AsyncEngine` interface): the step loop runs in its own
thread; `add()` streams deltas into the caller's event loop; abort frees the cache.

Failures (docs/RELIABILITY.md): the step loop (engine/step_loop.py) retries a failed step request
by request, so only the request that fails alone gets `RequestFailed`; a fatal error (CUDA, or a
one-token forward that fails) marks the engine dead, and every request in flight or arriving
gets `EngineDead`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.delta_stream import merged_deltas, on_loop
from engine.interface import EngineLifetime, SubmitThroughAdd, step_running_s
from engine.llm_engine import LLMEngine
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)
from engine.step_loop import StepLoop

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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # vLLM's: None first, the prompt token first
    prompt_logprob_ranks: list[int | None] | None = None


class LLM:
    def __init__(self, model: str | EngineArgs | dict = "", **engine_args):
        """vLLM's `LLM(model, **engine_args)`, or engine arguments as the other fronts take them."""
        args = {"model": model} if isinstance(model, str) else dataclasses.asdict(EngineArgs.of(model))
        self.engine = LLMEngine(EngineArgs.from_dict({**args, **engine_args}))
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
            prompt = next((o for o in outs if o.prompt_logprobs is not None), None)
            results.append(Completion(rid, seq.prompt_token_ids, list(seq.output_token_ids),
                                      "".join(o.text for o in outs), seq.finish_reason,
                                      seq.cumulative_logprob, logprobs,
                                      prompt and prompt.prompt_logprobs, prompt and prompt.prompt_logprob_ranks))
        return results


class AsyncLLM(SubmitThroughAdd, EngineLifetime):
    """The native engine behind the async interface the Triton backend uses: the step loop
    (engine/step_loop.py) in a thread of this process, deltas onto each caller's event loop."""

    def __init__(self, engine_args: dict | EngineArgs):
        self.args = EngineArgs.of(engine_args)
        self.engine: LLMEngine | None = None
        self.tokenizer = None
        self._steps: StepLoop | None = None
        self._cmds: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        # request id -> (caller's loop, its delta queue); the step thread owns both dicts
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._admitting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, asyncio.Future]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = False
        self._dead: str | None = None
        # _closed: the step thread handles no more commands; set with _lock held, so an add either
        # lands before (and is answered by the thread) or sees it (and fails at once)
        self._lock = threading.Lock()
        self._closed = False
        self._pending_adds = 0  # add commands queued, not handled yet (admission fast path)
        self._rejected_early = 0  # refused by the fast path, before the step thread saw them
        self._step_since: float | None = None  # when the step (or probe) now running began
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()

    @property
    def _hang_release(self) -> threading.Event:  # fault injection: lets a "hung" step go
        return self._steps.faults.hang_release

    async def start(self) -> None:
        self.engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, self.args)
        self.tokenizer = self.engine.tokenizer
        self._steps = StepLoop(self.engine, _StreamSink(self), stamp=self._stamp, on_compiled=self._wake.set)
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()
        if self.args.step_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="dsv4-watchdog", daemon=True)
            self._watchdog.start()
        self._accepting = True

    # --- the interface ------------------------------------------------------------------------

    async def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDead(f"engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDead("engine is not accepting requests (starting or shutting down)")
        # fast path: refuse at once, not after the step in progress; the step loop re-checks
        queued = self._pending_adds + self.engine.num_waiting
        if queued >= self.args.max_waiting_requests:
            self._rejected_early += 1
            raise EngineOverloaded(f"{queued} requests waiting or arriving (max_waiting_requests="
                                   f"{self.args.max_waiting_requests}); retry later")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        with self._lock:
            if self._closed:
                raise EngineDead(f"engine stopped: {self._dead or 'shut down'}")
            self._pending_adds += 1
            self._cmds.put(("add", request, loop, stream, admitted))
        self._wake.set()
        try:
            await admitted  # InvalidRequest / EngineOverloaded / EngineDead surface here, before any delta
        except asyncio.CancelledError:  # the caller left while its grammar compiled or it queued
            self._command(("abort", request.request_id))
            raise
        finished = False
        try:
            async for out in merged_deltas(stream):
                finished = out.finished
                yield out
        except Exception:
            finished = True  # the engine ended it (failed, dead): nothing to abort
            raise
        finally:
            if not finished:  # the consumer went away (cancelled, disconnected): free the cache
                self._command(("abort", request.request_id))

    async def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def stats(self) -> dict:
        if self._steps is None:
            return {}
        out = self._steps.stats()
        out["num_requests_rejected"] += self._rejected_early
        out["step_running_s"] = step_running_s(self._step_since)
        return out

    def health(self) -> bool:
        return self.engine is not None and self._dead is None and self._thread is not None and self._thread.is_alive()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while (self._streams or self._admitting) and time.monotonic() < deadline and self.health():
            await asyncio.sleep(0.05)
        self._command(("abort_all",))
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        # gone before the interpreter exits: a daemon thread waking during finalization can abort it
        self._watch_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(5)

    def _command(self, cmd: tuple) -> None:
        with self._lock:
            if not self._closed:
                self._cmds.put(cmd)
        self._wake.set()

    # --- the step thread ----------------------------------------------------------------------

    def _stamp(self, since: float | None) -> None:
        self._step_since = since

    def _send(self, request_id: str, item, done: bool = False) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        if done:
            del self._streams[request_id]
        on_loop(loop, stream.put_nowait, item)

    @staticmethod
    def _resolve(loop, future, error: BaseException | None = None) -> None:
        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(True)
        on_loop(loop, settle)

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request, loop, stream, admitted = cmd
            with self._lock:
                self._pending_adds -= 1
            rid = request.request_id
            if self._dead:
                self._resolve(loop, admitted, EngineDead(f"engine stopped: {self._dead}"))
            elif rid in self._admitting:
                self._resolve(loop, admitted, InvalidRequest(f"request id {rid!r} is already in flight"))
            else:
                self._admitting[rid] = (loop, stream, admitted)
                self._steps.add(request)
        elif cmd[0] == "abort":
            self._steps.abort([cmd[1]])
        elif cmd[0] == "abort_all":
            self._steps.abort_all()

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: stop, and say so
            log.exception("the engine loop crashed")
            self._dead = self._dead or f"engine loop crashed: {e!r}"
        finally:
            self._close()

    def _run(self) -> None:
        while not self._stop:
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                self._handle(cmd)
            fatal = self._steps.step()
            if fatal is not None:
                self._die(fatal)
            elif not self._steps.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _watch(self) -> None:
        """The step watchdog: a step that runs longer than step_timeout_s (a hung GPU, a deadlock)
        raises nothing, so without this every request would wait forever and health would stay
        true. Declare the engine dead instead: requests in flight and waiting for admission fail
        with EngineDead, new ones at once, and health() turns false (the Triton model then
        unloads, so readiness says so). The hung thread itself cannot be stopped; if it ever
        returns, it sees the engine stopped and closes."""
        timeout = self.args.step_timeout_s
        while not self._watch_stop.wait(min(1.0, timeout / 4)) and not self._closed and self._dead is None:
            since = self._step_since
            if since is None or time.monotonic() - since <= timeout:
                continue
            self._dead = f"a step has run for more than {timeout:g} s (step_timeout_s): hung"
            log.critical("the engine is dead: %s", self._dead)
            self._stop = True
            reason = EngineDead(f"engine stopped: {self._dead}")
            self._close_commands(reason)
            # told, not forgotten: the step thread owns these
            for loop, _, admitted in list(self._admitting.values()):
                self._resolve(loop, admitted, reason)
            for loop, stream in list(self._streams.values()):
                on_loop(loop, stream.put_nowait, reason)

    def _close_commands(self, reason: EngineDead) -> None:
        """No command is handled any more: adds fail at once from now on, queued ones here."""
        with self._lock:
            self._closed = True
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._resolve(cmd[2], cmd[4], reason)

    def _close(self) -> None:
        """The thread is ending (shutdown, or the engine died): nothing may wait on it any more."""
        self._watch_stop.set()
        reason = EngineDead(f"engine stopped: {self._dead or 'shut down'}")
        self._close_commands(reason)
        if self._dead:  # free every request's cache; each stream gets the reason below
            self._steps.compiling = []
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        else:
            self._steps.abort_all()
        for loop, _, admitted in list(self._admitting.values()):
            self._resolve(loop, admitted, reason)
        self._admitting.clear()
        for rid in list(self._streams):
            self._send(rid, reason, done=True)

    def _die(self, exc: BaseException) -> None:
        self._dead = f"{type(exc).__name__}: {exc}"
        log.critical("the engine is dead: %s", self._dead)
        self._stop = True  # _close fails every request in flight and every pending add


class _StreamSink:
    """The step loop's outputs onto the callers' event loops (AsyncLLM's transport)."""

    def __init__(self, front: AsyncLLM):
        self.front = front

    def admitted(self, request_id: str) -> None:
        loop, stream, admitted = self.front._admitting.pop(request_id)
        self.front._streams[request_id] = (loop, stream)
        self.front._resolve(loop, admitted)

    def refused(self, request_id: str, error: Exception) -> None:
        loop, _, admitted = self.front._admitting.pop(request_id)
        self.front._resolve(loop, admitted, error)

    def output(self, out: RequestOutput) -> None:
        if out.request_id in self.front._admitting:  # aborted while its grammar compiled
            self.admitted(out.request_id)
        self.front._send(out.request_id, out, done=out.finished)

    def failed(self, request_id: str, message: str) -> None:
        if request_id in self.front._admitting:
            self.admitted(request_id)
        self.front._send(request_id, RequestFailed(message), done=True)
