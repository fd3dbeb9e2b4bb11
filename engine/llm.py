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
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    merge_outputs,
)
from engine.sequence import Sequence

log = logging.getLogger("deepseek.engine")

# A request in this many failed steps is failed even when it never fails alone (a fault that
# needs a particular batch would otherwise retry forever).
MAX_SUSPICIONS = 3
HANG_RELEASE_S = 120.0  # fault injection: a "hung" step unblocks by itself after this long at most


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


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection (EngineArgs.fault_injection_marker)."""


class InjectedFatalFault(InjectedFault):
    """The injected stand-in for an error that leaves the device unusable (a CUDA error)."""


def is_fatal(exc: BaseException) -> bool:
    """Errors after which no step can be trusted: the device context is broken."""
    if isinstance(exc, InjectedFatalFault | MemoryError | SystemError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8: CUDA errors
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on a caller's event loop, from the step thread (or the watchdog)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed
        pass


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
        # _closed: the step thread handles no more commands; set with _lock held, so an add either
        # lands before (and is answered by the thread) or sees it (and fails at once)
        self._lock = threading.Lock()
        self._closed = False
        self._pending_adds = 0  # add commands queued, not handled yet (admission fast path)
        self._suspicions: dict[str, int] = {}  # request id -> failed steps it was in
        self._step_since: float | None = None  # when the step (or probe) now running began
        self._hang_release = threading.Event()  # fault injection: lets a "hung" step go
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._faults: dict[str, str] = {}  # fault injection (test-only): request id -> "step" | "fatal"
        self.counters = {"num_step_failures": 0, "num_requests_failed": 0, "num_requests_rejected": 0}

    async def start(self) -> None:
        self.engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, self.args)
        self.tokenizer = self.engine.tokenizer
        if self.args.fault_injection_marker:
            self._install_fault_injection()
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
            while True:
                items = [await stream.get()]
                # a consumer that fell behind (150 streams in one event loop) takes what has
                # piled up as one delta: its per-delta work then scales with requests, not tokens
                while isinstance(items[-1], RequestOutput) and not items[-1].finished and not stream.empty():
                    items.append(stream.get_nowait())
                error = items.pop() if isinstance(items[-1], Exception) else None
                if items:
                    out = merge_outputs(items)
                    finished = out.finished
                    yield out
                if error is not None:
                    finished = True
                    raise error
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (cancelled, disconnected): free the cache
                self._command(("abort", request.request_id))

    async def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def stats(self) -> dict:
        if self.engine is None:
            return {}
        return {**self.engine.stats(), **self.counters}

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
            self._suspicions.pop(request_id, None)
            self._faults.pop(request_id, None)
        _on_loop(loop, stream.put_nowait, item)

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
        _on_loop(loop, settle)

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
            marker = self.args.fault_injection_marker
            if marker and request.prompt and marker in request.prompt:
                kinds = [k for k in ("fatal", "hang") if f"{marker}:{k}" in request.prompt]
                self._faults[request.request_id] = kinds[0] if kinds else "step"
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
                self._recover(e)
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
                _on_loop(loop, stream.put_nowait, reason)

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

    def _recover(self, exc: Exception) -> None:
        """A step raised. Preempt every running request (its cache may hold half a step), then
        run each one alone, recomputed from its tokens: the ones that fail alone are failed, the
        others carry on. A fatal error, or an engine that cannot run a one-token forward any
        more, kills the engine instead."""
        eng, sch = self.engine, self.engine.scheduler
        self.counters["num_step_failures"] += 1
        log.error("engine step failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        if is_fatal(exc):
            self._die(exc)
            return
        self._fail_orphans(exc)
        suspects = list(sch.running)  # the failed batch is among them
        for seq in suspects:
            self._requeue(seq)
            sch.waiting.remove(seq)  # out of the queue while they run one by one
        survivors, culprits = [], 0
        for seq in suspects:
            error = self._solo(seq)
            if error is not None and is_fatal(error):
                self._die(error)
                return
            if error is not None:
                culprits += 1
                self._fail(seq.request_id, error)
            elif seq.request_id in eng.requests:
                survivors.append(seq)
        if culprits == 0:  # every one passed alone: a transient fault, or one that needs this batch
            for seq in list(survivors):
                rid = seq.request_id
                self._suspicions[rid] = self._suspicions.get(rid, 0) + 1
                if self._suspicions[rid] >= MAX_SUSPICIONS:
                    survivors.remove(seq)
                    self._fail(rid, exc)
        sch.waiting.extendleft(reversed(survivors))  # back at the front, in their order
        if suspects and culprits == len(suspects) and not self._probe():
            self._die(exc)

    def _requeue(self, seq: Sequence) -> None:
        """Free a request's cache and queue it to recompute its tokens (preemption by recompute)."""
        sch = self.engine.scheduler
        if seq in sch.running:
            sch.running.remove(seq)
        elif seq in sch.waiting:
            sch.waiting.remove(seq)
        sch._preempt(seq)  # release, reset progress, front of the queue; its tokens so far are kept

    def _solo(self, seq: Sequence) -> Exception | None:
        """Step `seq` alone until it has recomputed what the failed step computed (and sampled
        one more token); its outputs stream as usual. Returns the error if a step fails. A
        survivor is left freed and out of the scheduler's queues (the caller re-queues it)."""
        eng, sch = self.engine, self.engine.scheduler
        target = seq.num_tokens
        waiting = sch.waiting
        sch.waiting, sch.running = deque([seq]), []
        error = None
        try:
            while seq.request_id in eng.requests and seq.num_computed_tokens < target:
                before = seq.num_computed_tokens
                self._emit(self._timed(eng.step))
                if seq.num_computed_tokens == before and seq.request_id in eng.requests:
                    break  # could not be scheduled: nothing learnt
            self._emit(self._timed(eng.flush))  # async scheduling: its last step's token
        except Exception as e:  # noqa: BLE001 - that is the answer
            error = e
        if error is None and seq.request_id in eng.requests:
            self._requeue(seq)  # the solo cache is not kept: it recomputes with the others
        sch.waiting, sch.running = waiting, []
        return error

    def _probe(self) -> bool:
        """Can the engine run a one-token forward at all? (every request of a failed step failed
        alone: either they are all bad, or the engine is)."""
        eng = self.engine
        seq = Sequence("__health_probe__", [0], SamplingParams(max_tokens=1))
        if not eng.scheduler._try_allocate(seq, 1):
            return True  # no room to tell; the requests that failed are gone, so next time there is
        try:
            self._timed(eng.runner.run, [(seq, 1)])
            return True
        except Exception:  # noqa: BLE001
            log.exception("a one-token forward failed: the engine is broken")
            return False
        finally:
            eng.scheduler.release(seq)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.counters["num_requests_failed"] += 1
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        self.engine.abort(request_id)  # frees its cache; its stream gets the error instead
        self._send(request_id, RequestFailed(f"engine step failed: {type(exc).__name__}: {exc}"), done=True)

    def _fail_orphans(self, exc: Exception) -> None:
        """Requests that finished inside the failed step lost their last output: fail them."""
        for rid in [r for r in self._streams if r not in self.engine.requests]:
            self.counters["num_requests_failed"] += 1
            self._send(rid, RequestFailed(f"engine step failed: {type(exc).__name__}: {exc}"), done=True)

    def _die(self, exc: BaseException) -> None:
        self._dead = f"{type(exc).__name__}: {exc}"
        log.critical("the engine is dead: %s", self._dead)
        self._stop = True  # _close fails every request in flight and every pending add

    # --- fault injection (tests only; off unless EngineArgs.fault_injection_marker is set) -----

    def _install_fault_injection(self) -> None:
        """A request whose prompt holds the marker makes every forward it is in raise, after the
        forward ran (the cache then holds half a step, the worst case); `<marker>:fatal` raises
        an error classed as fatal; `<marker>:hang` blocks the forward until `_hang_release` is
        set (at most HANG_RELEASE_S). Never set this in production."""
        log.warning("fault injection is ON (fault_injection_marker=%r): for tests only",
                    self.args.fault_injection_marker)
        runner = self.engine.runner
        run = runner.run

        def run_with_faults(scheduled, *args, **kwargs):
            logits = run(scheduled, *args, **kwargs)
            for seq, _ in scheduled:
                kind = self._faults.get(seq.request_id)
                if kind == "hang":
                    self._hang_release.wait(HANG_RELEASE_S)
                    continue
                if kind == "fatal":
                    raise InjectedFatalFault(f"injected fatal fault (request {seq.request_id})")
                if kind:
                    raise InjectedFault(f"injected fault (request {seq.request_id})")
            return logits

        runner.run = run_with_faults
