"""The engine core process: owns the device, scheduler, runner, KV cache and prefix cache.

Spawned by engine/core_client.py (`run_core` is its entry point). One thread runs the step loop
(engine/step_loop.py): it takes the front's commands between steps, runs a step, and sends one
`StepOutputs` message per step with every request's new token ids (no text: the front
detokenizes and matches stop strings). A fatal error sends `CoreDead` and exits,
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

from engine import hop_trace, messages
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
from engine.request import GenerationRequest, RequestOutput
from engine.step_loop import StepLoop

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
        exit_now(1)
    conn.send_bytes(messages.encode(CoreReady(os.getpid(), engine.max_model_len)))
    CoreLoop(engine, conn, step_since).run()
    exit_now(0)


def exit_now(code: int) -> None:
    """End the core without the interpreter's teardown: its last message is in the pipe already, and
    the teardown (torch's modules, the model's tensors, a grammar compile that xgrammar cannot stop)
    took 0.5-1.5 s on an idle 2-core machine, 6 s under load, and a shutdown waited for it. The kernel
    frees the memory; tensor-parallel ranks die with this process (PR_SET_PDEATHSIG)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CoreLoop:
    """The step loop (engine/step_loop.py) over the pipe: messages in, one StepOutputs per step out."""

    def __init__(self, engine: LLMEngine, conn, step_since):
        self.engine, self.conn, self.step_since = engine, conn, step_since
        self.steps = StepLoop(engine, self, stamp=self._stamp)
        self.outputs: list[RequestOutput] = []  # for the next StepOutputs message
        self.errors: list[RequestError] = []
        self.stop = False
        self.stats_at = 0.0
        self.stats_busy = False  # whether the engine had work when the last stats were sent

    def run(self) -> None:
        while not self.stop:
            busy = self.steps.has_work()
            if self.conn.poll(0 if busy else COMPILE_POLL_S if self.steps.compiling else IDLE_POLL_S):
                while not self.stop and self.conn.poll(0):
                    self._handle(messages.decode(self.conn.recv_bytes()))
            if not self.stop:
                fatal = self.steps.step()
                if fatal is not None:
                    self._send_step()
                    reason = f"{type(fatal).__name__}: {fatal}"
                    log.critical("the engine core is dead: %s", reason)
                    self.conn.send_bytes(messages.encode(CoreDead(reason)))
                    exit_now(1)
            self._send_step()

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            hop_trace.mark(msg.request_id, "core_received")
            self.steps.add(GenerationRequest(msg.request_id, msg.prompt, msg.prompt_token_ids, msg.sampling))
        elif isinstance(msg, AbortRequests):
            self.steps.abort(msg.request_ids)
        elif isinstance(msg, Shutdown):
            self.steps.abort_all()
            self.stop = True

    # --- the step loop's sink: what the front hears -------------------------------------------

    def admitted(self, request_id: str) -> None:
        pass  # the front learns from the request's first output

    def refused(self, request_id: str, error: Exception) -> None:
        self.errors.append(RequestError(request_id, messages.error_kind(error), str(error)))

    def output(self, out: RequestOutput) -> None:
        self.outputs.append(out)

    def failed(self, request_id: str, message: str) -> None:
        self.errors.append(RequestError(request_id, "failed", message))

    def _stamp(self, since: float | None) -> None:
        """When the step now running began, in shared memory: the front's watchdog reads it."""
        self.step_since.value = since or 0.0

    def _send_step(self) -> None:
        now, busy = time.monotonic(), self.engine.has_unfinished()
        stats = None
        if now - self.stats_at >= STATS_INTERVAL_S or busy != self.stats_busy:  # going idle: say so now
            self.stats_at, self.stats_busy = now, busy
            stats = {**self.steps.stats(), "core_cpu_s": time.process_time()}
        if self.outputs or self.errors or stats is not None:
            msg = StepOutputs(self.outputs, self.errors, stats)
            self.outputs, self.errors = [], []
            data = messages.encode(msg)
            sent_at = time.monotonic()
            self.conn.send_bytes(data)
            if hop_trace.enabled():
                self._trace(msg, sent_at)

    @staticmethod
    def _trace(msg: StepOutputs, sent_at: float) -> None:
        for out in msg.outputs:
            hop_trace.mark(out.request_id, "core_sent", out.num_output_tokens, sent_at)
            if out.finished:
                hop_trace.done(out.request_id)
        for err in msg.errors:
            hop_trace.done(err.request_id)
