"""Fronts of the native engine.

`LLM`: offline, for tests and benchmarks: `LLM(model_dir).generate(prompts, SamplingParams(...))`.
`AsyncLLM`: the serving front (the `AsyncEngine` interface): the step loop runs in its own
thread; `add()` streams deltas into the caller's event loop; abort frees the cache.

Failures (docs/RELIABILITY.md): a step that raises is retried request by request, each alone
and recomputed from its tokens (preemption by recompute), so only the request that fails alone
gets `RequestFailed`; a fatal error (CUDA, or a one-token forward that fails) marks the engine
dead, and every request in flight or arriving gets `EngineDead`.
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

from engine import fault_injection
from engine.args import EngineArgs
from engine.delta_stream import merged_deltas, on_loop
from engine.interface import EngineLifetime
from engine.llm_engine import LLMEngine
from engine.recovery import StepRecovery
from engine.request import (
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


class AsyncLLM(EngineLifetime):
    """The native engine behind the async interface the Triton backend uses."""

    def __init__(self, engine_args: dict | EngineArgs):
        self.args = EngineArgs.of(engine_args)
        self.engine: LLMEngine | None = None
        self.tokenizer = None
        self._cmds: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = False
        self._dead: str | None = None
        # _closed: the step thread handles no more commands; set with _lock held, so an add either
        # lands before (and is answered by the thread) or sees it (and fails at once)
        self._lock = threading.Lock()
        self._closed = False
        self._pending_adds = 0  # add commands queued, not handled yet (admission fast path)
        self._recovery: StepRecovery | None = None
        self._faults: fault_injection.FaultInjectingRunner | None = None  # tests only
        self._step_since: float | None = None  # when the step (or probe) now running began
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self.counters = {"num_requests_failed": 0, "num_requests_rejected": 0}

    @property
    def _hang_release(self) -> threading.Event:  # fault injection: lets a "hung" step go
        return self._faults.hang_release

    async def start(self) -> None:
        self.engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, self.args)
        self.tokenizer = self.engine.tokenizer
        self._faults = fault_injection.install(self.engine, self.args.fault_injection_marker)
        self._recovery = StepRecovery(self.engine, self._emit, self._fail, self._timed)
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
        # fast path: refuse at once, not after the step in progress; the step thread re-checks
        queued = self._pending_adds + self.engine.num_waiting
        if queued >= self.args.max_waiting_requests:
            self.counters["num_requests_rejected"] += 1
            raise EngineOverloaded(f"{queued} requests waiting or arriving (max_waiting_requests="
                                   f"{self.args.max_waiting_requests}); retry later")
        loop = asyncio.get_running_loop()
        if request.sampling.structured_outputs is not None:  # compiled off the step loop; a bad spec fails here
            compiler = await loop.run_in_executor(None, self.engine.grammar_compiler)
            await asyncio.wrap_future(compiler.compile(request.sampling.structured_outputs))
        stream: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        with self._lock:
            if self._closed:
                raise EngineDead(f"engine stopped: {self._dead or 'shut down'}")
            self._pending_adds += 1
            self._cmds.put(("add", request, loop, stream, admitted))
        self._wake.set()
        await admitted  # InvalidRequest / EngineOverloaded / EngineDead surface here, before any delta
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
        if self.engine is None:
            return {}
        return {**self.engine.stats(), **self.counters, "num_step_failures": self._recovery.num_step_failures}

    def health(self) -> bool:
        return self.engine is not None and self._dead is None and self._thread is not None and self._thread.is_alive()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.health():
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

    def _send(self, request_id: str, item, done: bool = False) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        if done:
            del self._streams[request_id]
            self._recovery.forget(request_id)
            if self._faults is not None:
                self._faults.forget(request_id)
        on_loop(loop, stream.put_nowait, item)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:  # its sampling failed (one line, no traceback); the engine freed it
                self.counters["num_requests_failed"] += 1
                log.error("request %s failed: %s", out.request_id, out.error)
                self._send(out.request_id, RequestFailed(f"sampling failed: {out.error}"), done=True)
                continue
            self._send(out.request_id, out, done=out.finished)

    @staticmethod
    def _resolve(loop, future, error: BaseException | None = None) -> None:
        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(True)
        on_loop(loop, settle)

    def _handle(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, request, loop, stream, admitted = cmd
            with self._lock:
                self._pending_adds -= 1
            try:
                if self._dead:
                    raise EngineDead(f"engine stopped: {self._dead}")
                if eng.num_waiting >= self.args.max_waiting_requests:
                    self.counters["num_requests_rejected"] += 1
                    raise EngineOverloaded(f"{eng.num_waiting} requests waiting (max_waiting_requests="
                                           f"{self.args.max_waiting_requests}); retry later")
                eng.add_request(request)
            except (InvalidRequest, EngineOverloaded, EngineDead) as e:
                self._resolve(loop, admitted, e)
                return
            except Exception as e:  # noqa: BLE001 - a bug in admission (tokenizer, ...) fails this request only
                log.exception("admitting request %s failed", request.request_id)
                self._resolve(loop, admitted, RequestFailed(f"admission failed: {e!r}"))
                return
            self._streams[request.request_id] = (loop, stream)
            if self._faults is not None:
                self._faults.register(request)
            self._resolve(loop, admitted)
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
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: stop, and say so
            log.exception("the engine loop crashed")
            self._dead = self._dead or f"engine loop crashed: {e!r}"
        finally:
            self._close()

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                self._handle(cmd)
            if not eng.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self._timed(eng.step)
            except Exception as e:  # noqa: BLE001 - find the request that fails, keep serving the others
                fatal = self._recovery.recover(e, list(self._streams))
                if fatal is not None:
                    self._die(fatal)
                continue
            self._emit(outputs)

    def _timed(self, fn, *args):
        """Run one step (or probe) where the watchdog can see how long it has been running."""
        self._step_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._step_since = None

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
            for loop, stream in list(self._streams.values()):  # told, not forgotten: the step thread owns _streams
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
        for rid in list(self.engine.requests):
            if self._dead:
                self.engine.abort(rid)
                self._send(rid, reason, done=True)
            else:
                out = self.engine.abort(rid)
                if out is not None:
                    self._send(rid, out, done=True)
        for rid in list(self._streams):
            self._send(rid, reason, done=True)

    # --- failures -----------------------------------------------------------------------------

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.counters["num_requests_failed"] += 1
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        self.engine.abort(request_id)  # frees its cache; its stream gets the error instead
        self._send(request_id, RequestFailed(f"engine step failed: {type(exc).__name__}: {exc}"), done=True)

    def _die(self, exc: BaseException) -> None:
        self._dead = f"{type(exc).__name__}: {exc}"
        log.critical("the engine is dead: %s", self._dead)
        self._stop = True  # _close fails every request in flight and every pending add
