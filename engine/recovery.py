"""What a step loop does when a step raises (docs/RELIABILITY.md): find the request that fails,
keep serving the others.

Every running request is preempted (its cache may hold half a step) and run alone, recomputed
from its tokens: the ones that fail alone are failed, the others carry on. A fatal error (CUDA,
out of memory), or an engine that cannot run a one-token forward any more, is the engine's
death. Used by the step loop (engine/step_loop.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from engine.fault_injection import InjectedFatalFault
from engine.llm_engine import LLMEngine
from engine.parallel import CollectiveFailed
from engine.request import RequestOutput, SamplingParams
from engine.sequence import Sequence

log = logging.getLogger("deepseek.engine")

# A request in this many failed steps is failed even when it never fails alone (a fault that
# needs a particular batch would otherwise retry forever).
MAX_SUSPICIONS = 3


def is_fatal(exc: BaseException) -> bool:
    """Errors after which no step can be trusted: the device context is broken, or a tensor-parallel peer."""
    if isinstance(exc, InjectedFatalFault | MemoryError | SystemError | CollectiveFailed):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8: CUDA errors
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return "CUDA error" in text or "device-side assert" in text


class StepRecovery:
    """`emit(outputs)` streams outputs as a step would; `fail(request_id, exc)` fails one request
    (aborts it in the engine and tells its stream); `timed(fn, *args)` runs a step where a
    watchdog can see it."""

    def __init__(self, engine: LLMEngine, emit: Callable[[list[RequestOutput]], None],
                 fail: Callable[[str, BaseException], None], timed: Callable = lambda fn, *a: fn(*a)):
        self.engine, self.emit, self.fail, self.timed = engine, emit, fail, timed
        self.suspicions: dict[str, int] = {}  # request id -> failed steps it was in
        self.num_step_failures = 0

    def forget(self, request_id: str) -> None:
        self.suspicions.pop(request_id, None)

    def recover(self, exc: Exception, streaming: list[str]) -> BaseException | None:
        """A step raised; `streaming`: the ids of every request whose stream is open. Returns the
        error that killed the engine, or None when it serves on."""
        eng, sch = self.engine, self.engine.scheduler
        self.num_step_failures += 1
        # one line (a client may trigger this at will); the traceback at debug level, fatal ones in full
        log.error("engine step failed: %s: %s", type(exc).__name__, exc, exc_info=exc if is_fatal(exc) else None)
        log.debug("engine step failure", exc_info=exc)
        if is_fatal(exc):
            return exc
        for rid in [r for r in streaming if r not in eng.requests]:
            self.fail(rid, exc)  # finished inside the failed step: its last output was lost
        suspects = list(sch.running)  # the failed batch is among them
        for seq in suspects:
            self.requeue(seq)
            sch.waiting.remove(seq)  # out of the queue while they run one by one
        survivors, culprits = [], 0
        for seq in suspects:
            error = self.solo(seq)
            if error is not None and is_fatal(error):
                return error
            if error is not None:
                culprits += 1
                self.fail(seq.request_id, error)
            elif seq.request_id in eng.requests:
                survivors.append(seq)
        if culprits == 0:  # every one passed alone: a transient fault, or one that needs this batch
            for seq in list(survivors):
                rid = seq.request_id
                self.suspicions[rid] = self.suspicions.get(rid, 0) + 1
                if self.suspicions[rid] >= MAX_SUSPICIONS:
                    survivors.remove(seq)
                    self.fail(rid, exc)
        sch.waiting.extendleft(reversed(survivors))  # back at the front, in their order
        if suspects and culprits == len(suspects) and not self.probe():
            return exc
        return None

    def requeue(self, seq: Sequence) -> None:
        """Free a request's cache and queue it to recompute its tokens (preemption by recompute)."""
        sch = self.engine.scheduler
        if seq in sch.running:
            sch.running.remove(seq)
        elif seq in sch.waiting:
            sch.waiting.remove(seq)
        sch._preempt(seq)  # release, reset progress, front of the queue; its tokens so far are kept

    def solo(self, seq: Sequence) -> Exception | None:
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
                self.emit(self.timed(eng.step))
                if seq.num_computed_tokens == before and seq.request_id in eng.requests:
                    break  # could not be scheduled: nothing learnt
            self.emit(self.timed(eng.flush))  # async scheduling: its last step's token
        except Exception as e:  # noqa: BLE001 - that is the answer
            error = e
        if error is None and seq.request_id in eng.requests:
            self.requeue(seq)  # the solo cache is not kept: it recomputes with the others
        sch.waiting, sch.running = waiting, []
        return error

    def probe(self) -> bool:
        """Can the engine run a one-token forward at all? (every request of a failed step failed
        alone: either they are all bad, or the engine is)."""
        eng = self.engine
        seq = Sequence("__health_probe__", [0], SamplingParams(max_tokens=1))
        if not eng.scheduler._try_allocate(seq, 1):
            return True  # no room to tell; the requests that failed are gone, so next time there is
        try:
            self.timed(eng.runner.run, [(seq, 1)])
            return True
        except Exception:  # noqa: BLE001
            log.exception("a one-token forward failed: the engine is broken")
            return False
        finally:
            eng.scheduler.release(seq)
