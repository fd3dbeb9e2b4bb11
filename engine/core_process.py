"""The engine core process: owns the device, scheduler, runner, KV cache and prefix cache.

Spawned by engine/core_client.py (`run_core` is its entry point). One thread steps: it takes
the front's commands between steps, runs a step, and sends one `StepOutputs` message per step
with every request's new token ids (no text: the front detokenizes and matches stop strings).
A step that raises goes through engine/recovery.py; a fatal error sends `CoreDead` and exits,
and the front restarts the process. It writes when its step began into `step_since`, shared
memory the front's watchdog reads: a hung step gets the process killed.

The process dies with its parent (PR_SET_PDEATHSIG), so it never outlives the Triton stub.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

from engine import fault_injection, messages
from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreReady,
    RequestError,
    Shutdown,
    StepOutputs,
)
from engine.recovery import StepRecovery
from engine.request import EngineOverloaded, GenerationRequest, InvalidRequest, RequestOutput

log = logging.getLogger("deepseek.engine")

IDLE_POLL_S = 0.1  # an idle core waits this long for a command (and sends its stats) per turn
COMPILE_POLL_S = 0.005  # an idle core with grammars compiling looks at them this often
STATS_INTERVAL_S = 0.1  # stats ride on a step message at most this often
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that spawned it exits (also after `kill -9` of the
    parent); if the parent is already gone, exit now."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's shutdown still kills it
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def run_core(engine_args: dict, conn, step_since, parent_pid: int) -> None:
    """The spawned process's main: load the engine, say ready, step until told to stop."""
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine-core[%(process)d] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the front, which stops us
    try:
        engine = LLMEngine(EngineArgs.from_dict(engine_args), detokenize=False)
    except BaseException as e:  # noqa: BLE001 - tell the front why, then exit
        log.exception("the engine core failed to load")
        conn.send_bytes(messages.encode(CoreDead(f"the engine core failed to load: {type(e).__name__}: {e}")))
        sys.exit(1)
    conn.send_bytes(messages.encode(CoreReady(os.getpid(), engine.max_model_len)))
    CoreLoop(engine, conn, step_since).run()


class CoreLoop:
    def __init__(self, engine: LLMEngine, conn, step_since):
        self.engine, self.conn, self.step_since = engine, conn, step_since
        self.faults = fault_injection.install(engine, engine.args.fault_injection_marker)
        self.recovery = StepRecovery(engine, self._emit, self._fail, self._timed)
        self.live: set[str] = set()  # admitted and not finished: the front holds their streams
        self.outputs: list[RequestOutput] = []  # for the next StepOutputs message
        self.errors: list[RequestError] = []
        self.stop = False
        self.stats_at = 0.0
        self.stats_busy = False  # whether the engine had work when the last stats were sent
        self.num_steps = 0
        self.counters = {"num_requests_failed": 0, "num_requests_rejected": 0}
        self.compiling: list[tuple[object, AddRequest]] = []  # (compile future, request) off the step loop

    def run(self) -> None:
        eng = self.engine
        while not self.stop:
            busy = eng.has_unfinished()
            if self.conn.poll(0 if busy else COMPILE_POLL_S if self.compiling else IDLE_POLL_S):
                while not self.stop and self.conn.poll(0):
                    self._handle(messages.decode(self.conn.recv_bytes()))
            self._admit_compiled()
            if not self.stop and eng.has_unfinished():
                try:
                    self._emit(self._timed(eng.step))
                    self.num_steps += 1
                except Exception as e:  # noqa: BLE001 - find the request that fails, keep serving the others
                    fatal = self.recovery.recover(e, list(self.live))
                    if fatal is not None:
                        self._send_step()
                        reason = f"{type(fatal).__name__}: {fatal}"
                        log.critical("the engine core is dead: %s", reason)
                        self.conn.send_bytes(messages.encode(CoreDead(reason)))
                        sys.exit(1)
            self._send_step()

    def _handle(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, AddRequest) and msg.sampling.structured_outputs is not None:
            # its grammar compiles on the compiler's threads; the request is admitted once it is done
            try:
                self.compiling.append((eng.grammar_compiler().compile(msg.sampling.structured_outputs), msg))
            except InvalidRequest as e:
                self.errors.append(RequestError(msg.request_id, messages.error_kind(e), str(e)))
        elif isinstance(msg, AddRequest):
            self._admit(msg)
        elif isinstance(msg, AbortRequests):
            aborted = set(msg.request_ids)
            for _, waiting in self.compiling:
                if waiting.request_id in aborted:
                    self._emit([RequestOutput(waiting.request_id, finished=True, finish_reason="abort")])
            self.compiling = [c for c in self.compiling if c[1].request_id not in aborted]
            for rid in msg.request_ids:
                out = eng.abort(rid)
                if out is not None:
                    self._emit([out])
        elif isinstance(msg, Shutdown):
            for _, waiting in self.compiling:
                self._emit([RequestOutput(waiting.request_id, finished=True, finish_reason="abort")])
            self.compiling = []
            for rid in list(eng.requests):
                self._emit([eng.abort(rid)])
            self.stop = True

    def _admit_compiled(self) -> None:
        if not self.compiling:
            return
        done = [c for c in self.compiling if c[0].done()]
        self.compiling = [c for c in self.compiling if not c[0].done()]
        for _, msg in done:
            self._admit(msg)  # a spec that failed to compile raises InvalidRequest there: refused

    def _admit(self, msg: AddRequest) -> None:
        eng = self.engine
        rid = msg.request_id
        try:
            if eng.num_waiting >= eng.args.max_waiting_requests:
                self.counters["num_requests_rejected"] += 1
                raise EngineOverloaded(f"{eng.num_waiting} requests waiting (max_waiting_requests="
                                       f"{eng.args.max_waiting_requests}); retry later")
            request = GenerationRequest(rid, msg.prompt, msg.prompt_token_ids, msg.sampling)
            eng.add_request(request)
        except (InvalidRequest, EngineOverloaded) as e:
            self.errors.append(RequestError(rid, messages.error_kind(e), str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a bug in admission fails this request only
            log.exception("admitting request %s failed", rid)
            self.errors.append(RequestError(rid, "failed", f"admission failed: {e!r}"))
            return
        self.live.add(rid)
        if self.faults is not None:
            self.faults.register(request)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:  # its sampling failed (one line, no traceback); the engine freed it
                self.counters["num_requests_failed"] += 1
                log.error("request %s failed: %s", out.request_id, out.error)
                self.errors.append(RequestError(out.request_id, "failed", f"sampling failed: {out.error}"))
            else:
                self.outputs.append(out)
            if out.finished:
                self._forget(out.request_id)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.counters["num_requests_failed"] += 1
        log.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
        self.engine.abort(request_id)  # frees its cache; its stream gets the error instead
        self._forget(request_id)
        self.errors.append(RequestError(request_id, "failed", f"engine step failed: {type(exc).__name__}: {exc}"))

    def _forget(self, request_id: str) -> None:
        self.live.discard(request_id)
        self.recovery.forget(request_id)
        if self.faults is not None:
            self.faults.forget(request_id)

    def _timed(self, fn, *args):
        """Run a step (or probe) where the front's watchdog sees how long it has been running."""
        self.step_since.value = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.step_since.value = 0.0

    def _send_step(self) -> None:
        now, busy = time.monotonic(), self.engine.has_unfinished()
        stats = None
        if now - self.stats_at >= STATS_INTERVAL_S or busy != self.stats_busy:  # going idle: say so now
            self.stats_at, self.stats_busy = now, busy
            stats = {**self.engine.stats(), **self.counters, "num_step_failures": self.recovery.num_step_failures,
                     "num_steps": self.num_steps, "core_cpu_s": time.process_time()}
        if self.outputs or self.errors or stats is not None:
            msg = StepOutputs(self.outputs, self.errors, stats)
            self.outputs, self.errors = [], []
            self.conn.send_bytes(messages.encode(msg))
