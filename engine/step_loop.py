"""The one step loop behind both fronts (AsyncLLM in-process, engine/llm.py; the engine core
process, engine/core_process.py): admit, abort, step with recovery, hand what happened to a sink.

The fronts differ only in transport: AsyncLLM's sink puts deltas on each caller's asyncio queue,
the core's batches them into one StepOutputs message per step. Both own the thread that calls
this loop; nothing here is thread-safe.

Failures (docs/RELIABILITY.md): a step that raises goes to engine/recovery.py, which retries the
requests one by one so only one that fails alone is failed; a fatal error is returned from
`step()` and the front stops (AsyncLLM: every request gets EngineDead; the core: CoreDead).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Protocol

from engine import fault_injection
from engine.llm_engine import LLMEngine
from engine.recovery import StepRecovery
from engine.request import EngineOverloaded, GenerationRequest, InvalidRequest, RequestFailed, RequestOutput

log = logging.getLogger("deepseek.engine")


class OutputSink(Protocol):
    def admitted(self, request_id: str) -> None:
        """The request is in the engine; deltas follow."""

    def refused(self, request_id: str, error: Exception) -> None:
        """Not admitted: InvalidRequest / EngineOverloaded (the client's or load's), RequestFailed (a bug)."""

    def output(self, out: RequestOutput) -> None:
        """A delta; `out.finished` ends the request's stream."""

    def failed(self, request_id: str, message: str) -> None:
        """The admitted request failed alone (its sampling or its step); its stream ends here."""


class StepLoop:
    def __init__(self, engine: LLMEngine, sink: OutputSink, stamp=None, on_compiled=None):
        """stamp(t): when the step (or recovery probe) now running began, None once it returned: a
        front's watchdog reads it. on_compiled(): called from a compiler thread when a grammar is
        ready, so an idle front wakes to admit its request."""
        self.engine, self.sink = engine, sink
        self.stamp = stamp or (lambda t: None)
        self.on_compiled = on_compiled
        self.faults = fault_injection.install(engine, engine.args.fault_injection_marker)
        self.recovery = StepRecovery(engine, self._emit, self._fail, self._timed)
        self.live: set[str] = set()  # admitted and not finished
        self.compiling: list[tuple[Future, GenerationRequest]] = []  # grammars compiling off the loop
        self.counters = {"num_requests_failed": 0, "num_requests_rejected": 0}
        self.num_steps = 0

    # --- commands -----------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Admit now, or (structured outputs) once its grammar has compiled on the compiler's threads."""
        if request.sampling.structured_outputs is None:
            self._admit(request)
            return
        try:
            future = self.engine.grammar_compiler().compile(request.sampling.structured_outputs)
        except (InvalidRequest, EngineOverloaded) as e:  # a bad spec; too many compiles at once
            if isinstance(e, EngineOverloaded):
                self.counters["num_requests_rejected"] += 1
            self.sink.refused(request.request_id, e)
            return
        if self.on_compiled is not None:
            future.add_done_callback(lambda _: self.on_compiled())
        self.compiling.append((future, request))

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        for _, waiting in [c for c in self.compiling if c[1].request_id in ids]:
            self._emit([RequestOutput(waiting.request_id, finished=True, finish_reason="abort")])
        self.compiling = [c for c in self.compiling if c[1].request_id not in ids]
        for rid in request_ids:
            out = self.engine.abort(rid)
            if out is not None:
                self._emit([out])

    def abort_all(self) -> None:
        self.abort([r.request_id for _, r in self.compiling] + list(self.engine.requests))

    def pending(self) -> list[str]:
        """Every request the loop holds: compiling, waiting or running."""
        return [r.request_id for _, r in self.compiling] + list(self.engine.requests)

    # --- the step -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> BaseException | None:
        """Admit what has compiled, then one engine step if there is work. Returns a fatal error
        (the engine cannot go on), else None."""
        self._admit_compiled()
        if not self.engine.has_unfinished():
            return None
        try:
            self._emit(self._timed(self.engine.step))
            self.num_steps += 1
        except Exception as e:  # noqa: BLE001 - find the request that fails, keep serving the others
            return self.recovery.recover(e, list(self.live))
        return None

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters, "num_step_failures": self.recovery.num_step_failures,
                "num_steps": self.num_steps}

    # --- inside -------------------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        if not self.compiling:
            return
        done = [c for c in self.compiling if c[0].done()]
        self.compiling = [c for c in self.compiling if not c[0].done()]
        for future, request in done:
            error = future.exception()
            if error is None:
                self._admit(request)
                continue
            if isinstance(error, EngineOverloaded):
                self.counters["num_requests_rejected"] += 1
            self.sink.refused(request.request_id, error)  # a bad spec, over its budget, or too many compiling

    def _admit(self, request: GenerationRequest) -> None:
        eng, rid = self.engine, request.request_id
        try:
            if eng.num_waiting >= eng.args.max_waiting_requests:
                self.counters["num_requests_rejected"] += 1
                raise EngineOverloaded(f"{eng.num_waiting} requests waiting (max_waiting_requests="
                                       f"{eng.args.max_waiting_requests}); retry later")
            eng.add_request(request)
        except (InvalidRequest, EngineOverloaded) as e:
            self.sink.refused(rid, e)
            return
        except Exception as e:  # noqa: BLE001 - a bug in admission (tokenizer, ...) fails this request only
            log.exception("admitting request %s failed", rid)
            self.sink.refused(rid, RequestFailed(f"admission failed: {e!r}"))
            return
        self.live.add(rid)
        if self.faults is not None:
            self.faults.register(request)
        self.sink.admitted(rid)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:  # its sampling failed (one line, no traceback); the engine freed it
                self.counters["num_requests_failed"] += 1
                log.error("request %s failed: %s", out.request_id, out.error)
                self._forget(out.request_id)
                self.sink.failed(out.request_id, f"sampling failed: {out.error}")
                continue
            if out.finished:
                self._forget(out.request_id)
            self.sink.output(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.counters["num_requests_failed"] += 1
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        self.engine.abort(request_id)  # frees its cache; its stream gets the error instead
        self._forget(request_id)
        self.sink.failed(request_id, f"engine step failed: {type(exc).__name__}: {exc}")

    def _forget(self, request_id: str) -> None:
        self.live.discard(request_id)
        self.recovery.forget(request_id)
        if self.faults is not None:
            self.faults.forget(request_id)

    def _timed(self, fn, *args):
        self.stamp(time.monotonic())
        try:
            return fn(*args)
        finally:
            self.stamp(None)
