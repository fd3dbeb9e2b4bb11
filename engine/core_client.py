"""The front of the engine core process: the `AsyncEngine` interface (engine/interface.py) in
the Triton model's process, with the engine itself in a spawned process (engine/core_process.py).

The front tokenizes, sends typed messages (engine/messages.py) over a pipe, and turns the core's
token ids into text: detokenization, stop strings (a match finishes the request here and aborts
it in the core; tokens the core made past the stop are dropped) and the held-back text are this
side's work, never the step loop's. docs/PROCESSES.md has the picture.

A request started with `submit` (the Triton model's) is queued for the admission thread, which
tokenizes it (with the GIL released) and sends it, so the caller (Triton's execute thread, which
Triton calls once at a time per model instance) is free for the next arrival at once; its deltas
go to its sink on the reader thread as each step's message is read: no event loop on the way in
or out. One started with `add` gets its deltas on its event loop, one hop per loop
per step.

One supervisor thread per client spawns the core, reads its step messages, and watches it: a
core that exits (SIGKILL, CUDA error, out of memory) or whose step runs past step_timeout_s
(killed) fails every request in flight with EngineDead at once; health() is false while the
core is restarted (weights reloaded) after a backoff, up to core_restart_limit times, after which
the engine stays dead (the Triton model unloads). The core dies with the supervisor thread
(PR_SET_PDEATHSIG), so also with this process, even after `kill -9`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn as mp_spawn
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from engine import hop_trace, messages
from engine.args import EngineArgs, resolve_model_dir
from engine.delta_stream import merged_deltas, on_loop
from engine.interface import DeltaSink, EngineLifetime, step_running_s
from engine.messages import AbortRequests, AddRequest, CoreDead, CoreReady, Shutdown, StepOutputs
from engine.os_threads import named
from engine.output_text import OutputText
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
)
from engine.tokenizer import Tokenizer

log = logging.getLogger("deepseek.engine")

WATCH_TICK_S = 0.25  # how often the supervisor looks at the core's step clock when no message comes
STABLE_S = 600.0  # a core that served this long has its restart count reset
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 5.0  # shutdown: the core exits after its current step (engine/core_process.py exit_now); past this, killed


@dataclass(eq=False)
class _FrontRequest:
    """One request in flight, as the front sees it: its deltas go to `sink` (submit) or onto
    `stream` on `loop` (add)."""

    text: OutputText
    sink: DeltaSink | None = None
    loop: asyncio.AbstractEventLoop | None = None
    stream: asyncio.Queue | None = None


def _python_executable() -> str:
    """The interpreter to spawn the core with: inside Triton's stub sys.executable is the stub."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    for name in ("python3", "python"):
        candidate = os.path.join(sys.prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    return exe


def _core_main(*args) -> None:
    """The spawned process's target: the engine (torch, kernels) is imported there, not here,
    so this process never touches CUDA."""
    # OpenMP's idle threads spin by default; with another process beside it (the front, Triton,
    # a load generator) on few cores, the spinning took the CPU from the core's own work: 30x
    # slower steps on 2 cores (docs/PROCESSES.md). Set before torch loads libgomp.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from engine.core_process import run_core

    run_core(*args)


_spawn_lock = threading.Lock()


@contextlib.contextmanager
def _without_main_module():
    """Spawn re-imports the parent's __main__ in the child (a script, pytest, Triton's stub): the
    core needs none of it, and a script without a __main__ guard would start itself again."""
    with _spawn_lock:
        prepare = mp_spawn.get_preparation_data

        def without_main(name):
            data = prepare(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        mp_spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = prepare


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(None)


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.put_nowait(item)


class CoreClient(EngineLifetime):
    """The native engine behind the async interface, its core in a process of its own."""

    def __init__(self, engine_args: dict | EngineArgs):
        self.args = EngineArgs.of(engine_args)
        self.tokenizer: Tokenizer | None = None
        self._requests: dict[str, _FrontRequest] = {}
        self._lock = threading.Lock()  # _state changes and _requests' admissions
        self._send_lock = threading.Lock()
        self._ctx = mp.get_context("spawn")  # never fork: the parent may hold CUDA, threads, Triton's state
        self._conn = None
        self._proc = None
        self._step_since = None
        self._state = "new"  # new | serving | restarting | dead | stopped
        self._reason: str | None = None  # why it is not serving
        self._accepting = False
        self._stopping = threading.Event()
        self._stop_at = 0.0
        self._supervisor: threading.Thread | None = None
        self._admissions: queue.SimpleQueue = queue.SimpleQueue()  # (request, sink) from `submit`; None: stop
        self._admissions_open = False  # the admission thread takes what is queued (guarded by _admissions_lock)
        self._admissions_lock = threading.Lock()
        self._admitter: threading.Thread | None = None
        self._stats: dict = {}
        self.counters = {"num_core_restarts": 0, "front_cpu_s": 0.0, "num_requests_rejected_front": 0}
        atexit.register(self._kill_core)

    # --- the interface ------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tokenizer = await loop.run_in_executor(None, self._load_tokenizer)
        ready = loop.create_future()
        self._supervisor = threading.Thread(target=named("dsv4-supervisor", self._supervise), args=(loop, ready),
                                            name="dsv4-core-supervisor", daemon=True)
        self._supervisor.start()
        await ready  # a core that cannot load raises here (a bad configuration fails the model's load)
        self._admitter = threading.Thread(target=named("ds-admission", self._admission_loop),
                                          name="dsv4-admission", daemon=True)
        self._admissions_open = True
        self._admitter.start()
        self._accepting = True

    async def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        stream: asyncio.Queue = asyncio.Queue()
        self._admit(request, loop=asyncio.get_running_loop(), stream=stream)
        rid = request.request_id
        finished = False
        try:
            async for out in merged_deltas(stream):
                finished = out.finished
                yield out
        except Exception:
            finished = True  # the core ended it (refused, failed, dead): nothing to abort
            raise
        finally:
            if not finished and self._requests.pop(rid, None) is not None:  # the consumer went away
                self._send(AbortRequests([rid]))

    def submit(self, request: GenerationRequest, sink: DeltaSink,
               loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queue `request` for the admission thread and return: it tokenizes and sends it, and the
        reader thread hands its deltas to `sink` (a refusal goes to `sink.failed`, on the admission
        thread). `loop` is not needed."""
        with self._admissions_lock:
            if self._admissions_open:
                self._admissions.put((request, sink))
                return
        sink.failed(EngineDead(self._not_serving()))  # not started, or shut down: no admission thread

    def _admission_loop(self) -> None:
        """The submitted requests, in arrival order: tokenized here (the GIL released meanwhile, so
        the reader and the caller's response threads go on) and sent to the core."""
        while (item := self._admissions.get()) is not None:
            self._admit_to(*item)
        with self._admissions_lock:  # shut down: refuse what came in meanwhile (no longer accepting)
            self._admissions_open = False
        with contextlib.suppress(queue.Empty):
            while True:
                if (item := self._admissions.get_nowait()) is not None:
                    self._admit_to(*item)

    def _admit_to(self, request: GenerationRequest, sink: DeltaSink) -> None:
        hop_trace.mark(request.request_id, "admitting")
        try:
            self._admit(request, sink=sink)
        except Exception as e:  # noqa: BLE001 - the sink maps it (InvalidRequest, EngineOverloaded, EngineDead)
            try:
                sink.failed(e)
            except Exception:  # noqa: BLE001 - a bug in the sink must not stop admission
                log.exception("telling request %s's sink that it was refused failed", request.request_id)

    def _admit(self, request: GenerationRequest, **deliver) -> None:
        """Register `request` (its deltas go where `deliver` says: _FrontRequest's sink, or loop and
        stream) and send it to the core. Raises EngineDead, EngineOverloaded or InvalidRequest."""
        if not self.health() or not self._accepting:
            raise EngineDead(self._not_serving())
        if len(self._requests) >= self.args.max_num_seqs + self.args.max_waiting_requests:
            self.counters["num_requests_rejected_front"] += 1
            raise EngineOverloaded(f"{len(self._requests)} requests in flight (max_num_seqs + max_waiting_requests); "
                                   "retry later")
        ids = request.prompt_token_ids
        if ids is None:
            if not request.prompt:
                raise InvalidRequest("the prompt is empty")
            ids = self.tokenizer.encode(request.prompt)
        rid = request.request_id
        with self._lock:
            if self._state != "serving":
                raise EngineDead(self._not_serving())
            if rid in self._requests:
                raise InvalidRequest(f"request id {rid!r} is already in flight")
            self._requests[rid] = _FrontRequest(OutputText(self.tokenizer, request.sampling), **deliver)
        prompt = request.prompt if self.args.fault_injection_marker else None  # the core tokenizes nothing
        self._send(AddRequest(rid, prompt, list(ids), request.sampling))
        hop_trace.mark(rid, "submitted")

    async def abort(self, request_id: str) -> None:
        if request_id in self._requests:  # its stream ends with the core's "abort" output
            self._send(AbortRequests([request_id]))

    def stats(self) -> dict:
        stats = {**self._stats, **self.counters}
        stats["num_requests_rejected"] = (stats.get("num_requests_rejected", 0)
                                          + stats.pop("num_requests_rejected_front"))
        # read here, not from the core's last message: a hung core sends none
        stats["step_running_s"] = step_running_s(self._step_since.value if self._step_since is not None else None)
        return stats

    def health(self) -> bool:
        return self._state == "serving"

    @property
    def restarting(self) -> bool:
        """Not healthy now, but the core is coming back (backend/model.py keeps the model loaded)."""
        return self._state == "restarting"

    @property
    def core_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.is_alive() else None

    @property
    def core_exit_code(self) -> int | None:
        """How the last core process ended (negative: the signal that killed it); None while it runs."""
        proc = self._proc
        return None if proc is None else proc.exitcode

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._requests and time.monotonic() < deadline and self.health():
            await asyncio.sleep(0.05)
        self._stop_at = time.monotonic()
        self._stopping.set()
        self._admissions.put(None)  # the admission thread refuses what is queued behind it, and ends
        self._send(Shutdown())  # the core aborts what is left (their streams end "abort") and exits
        if self._supervisor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._supervisor.join, STOP_GRACE_S + 10)
        self._kill_core()

    # --- sending ------------------------------------------------------------------------------

    def _send(self, msg) -> None:
        data = messages.encode(msg)
        with self._send_lock:
            conn = self._conn
            if conn is None:
                return
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):  # the core is gone: the supervisor fails its requests
                pass

    def _not_serving(self) -> str:
        if self._state == "restarting":
            return f"the engine core is restarting after: {self._reason}"
        return f"engine stopped: {self._reason or ('starting' if self._state == 'new' else 'shut down')}"

    def _load_tokenizer(self) -> Tokenizer:
        return Tokenizer(self.args.tokenizer or resolve_model_dir(self.args.model))

    # --- the supervisor thread ----------------------------------------------------------------

    def _supervise(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future) -> None:
        restarts, first = 0, True
        while not self._stopping.is_set():
            reason = self._spawn()
            if reason is None:
                served_from = time.monotonic()
                with self._lock:
                    self._state, self._reason = "serving", None
                if first:
                    first = False
                    on_loop(loop, _settle, ready, None)
                reason = self._serve()
                if time.monotonic() - served_from > STABLE_S:
                    restarts = 0
            elif first and not self._stopping.is_set():
                self._reap()
                self._end("dead", reason)
                error = RuntimeError(reason)
                on_loop(loop, _settle, ready, error)
                return
            if self._stopping.is_set():
                break
            log.error("the engine core is gone: %s", reason)
            self._end("restarting", reason)  # every request in flight fails now, before the reaping
            self._reap()
            if restarts >= self.args.core_restart_limit:
                self._end("dead", f"{reason} (the engine core was restarted {restarts} times: "
                                  f"core_restart_limit={self.args.core_restart_limit})")
                log.critical("the engine core died and its restart budget is spent (core_restart_limit=%d): "
                             "the engine stays dead and the model unloads: %s", self.args.core_restart_limit, reason)
                return
            restarts += 1
            self.counters["num_core_restarts"] += 1
            delay = min(MAX_BACKOFF_S, self.args.core_restart_backoff_s * 2 ** (restarts - 1))
            log.warning("restarting the engine core in %.1f s (restart %d of %d)", delay, restarts,
                        self.args.core_restart_limit)
            if self._stopping.wait(delay):
                break
        self._reap()
        self._end("stopped", None)
        if first:
            on_loop(loop, _settle, ready, EngineDead("shut down"))

    def _end(self, state: str, reason: str | None) -> None:
        """The core is gone: refuse new requests and fail every one in flight."""
        with self._lock:
            self._state, self._reason = state, reason
            failed, self._requests = self._requests, {}
        error = EngineDead(f"engine stopped: {reason or 'shut down'}")
        by_loop: dict = {}
        for rid, req in failed.items():
            self._hand(rid, req, error, by_loop)
        for req_loop, items in by_loop.items():
            on_loop(req_loop, _put_all, items)

    def _spawn(self) -> str | None:
        """Start a core and wait until it has loaded: None, or why it did not."""
        ours, theirs = self._ctx.Pipe(duplex=True)
        self._step_since = self._ctx.RawValue("d", 0.0)
        if not hasattr(sys, "argv"):  # an embedded interpreter (Triton's stub) may have none; spawn reads it
            sys.argv = [""]
        executable = _python_executable()
        if executable != sys.executable:
            self._ctx.set_executable(executable)
        proc = self._ctx.Process(target=_core_main, name="dsv4-engine-core",
                                 args=(self._core_args(), theirs, self._step_since, os.getpid()))
        with _without_main_module():
            proc.start()
        theirs.close()
        with self._send_lock:
            self._conn, self._proc = ours, proc
        log.info("engine core process %d started", proc.pid)
        while True:
            ready = mp.connection.wait([ours, proc.sentinel], timeout=WATCH_TICK_S)
            if self._stopping.is_set():
                return "shut down while loading"
            if ours in ready:
                try:
                    msg = messages.decode(ours.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, CoreReady):
                    return None
                if isinstance(msg, CoreDead):
                    return msg.reason
                if msg is not None:
                    continue
            if ours in ready or proc.sentinel in ready:
                proc.join(5)
                return f"the engine core exited while loading ({self._exit_status(proc)})"

    def _core_args(self) -> dict:
        return asdict(self.args)

    def _serve(self) -> str | None:
        """Read the core's messages until it is gone: why, or None when we stopped it."""
        conn, proc, timeout = self._conn, self._proc, self.args.step_timeout_s
        while True:
            ready = mp.connection.wait([conn, proc.sentinel], timeout=WATCH_TICK_S)
            if conn in ready:
                read_at = time.monotonic()
                try:
                    msg = messages.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, StepOutputs):
                    self._deliver(msg, read_at)
                    continue
                if isinstance(msg, CoreDead):
                    return msg.reason
            if conn in ready or proc.sentinel in ready:  # end of the pipe, or the process is gone
                proc.join(1)
                if self._stopping.is_set():
                    return None
                return f"the engine core process exited ({self._exit_status(proc)})"
            since = self._step_since.value
            if timeout > 0 and since and time.monotonic() - since > timeout:
                reason = f"a step has run for more than {timeout:g} s (step_timeout_s): hung"
                log.critical("the engine core is hung (%s): killing process %d", reason, proc.pid)
                proc.kill()
                return reason
            if self._stopping.is_set() and time.monotonic() - self._stop_at > STOP_GRACE_S:
                log.error("the engine core did not stop within %g s: killing it", STOP_GRACE_S)
                proc.kill()
                return None

    @staticmethod
    def _exit_status(proc) -> str:
        code = proc.exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        proc.join(STOP_GRACE_S if self._stopping.is_set() else 2)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None

    def _kill_core(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    # --- the core's outputs, made text --------------------------------------------------------

    def _deliver(self, msg: StepOutputs, read_at: float) -> None:
        cpu = time.thread_time()
        if msg.stats is not None:
            self._stats = msg.stats
        by_loop: dict = {}
        stopped = []
        for out in msg.outputs:
            req = self._requests.get(out.request_id)
            if req is None:  # finished here already (a stop string, a consumer gone)
                continue
            core_finished = out.finished
            hop_trace.mark(out.request_id, "read", out.num_output_tokens, read_at)
            self._render(req, out)
            hop_trace.mark(out.request_id, "detokenized", out.num_output_tokens)
            if out.finished:
                self._requests.pop(out.request_id, None)
                if not core_finished:
                    stopped.append(out.request_id)
            if not self._hand(out.request_id, req, out, by_loop) and not out.finished:
                stopped.append(out.request_id)
        for err in msg.errors:
            req = self._requests.pop(err.request_id, None)
            if req is not None:
                self._hand(err.request_id, req, messages.ERRORS[err.kind](err.message), by_loop)
        for loop, items in by_loop.items():  # one hop per event loop per step, not per request
            on_loop(loop, _put_all, items)
        if stopped:  # a stop string matched here (or a sink failed): free the core's cache, drop what it makes
            self._send(AbortRequests(stopped))
        self.counters["front_cpu_s"] += time.thread_time() - cpu

    def _hand(self, rid: str, req: _FrontRequest, item: RequestOutput | BaseException, by_loop: dict) -> bool:
        """A delta or the request's error to its sink now, or onto `by_loop` for its event loop.
        False when the sink raised: a bug there ends its request (dropped here, aborted in the core,
        its sink told once more, so that its caller can still answer), never this thread."""
        if req.sink is None:
            by_loop.setdefault(req.loop, []).append((req.stream, item))
            return True
        try:
            if isinstance(item, RequestOutput):
                req.sink.output(item)
            else:
                req.sink.failed(item)
            return True
        except Exception as e:  # noqa: BLE001 - logged; the request is dropped
            log.exception("handing request %s its output failed; dropping it", rid)
            self._requests.pop(rid, None)
            if isinstance(item, RequestOutput):
                try:
                    req.sink.failed(RequestFailed(f"delivering its output failed: {type(e).__name__}: {e}"))
                except Exception:  # noqa: BLE001
                    log.exception("telling request %s's sink that it failed failed too", rid)
            return False

    @staticmethod
    def _render(req: _FrontRequest, out: RequestOutput) -> None:
        """Give `out` its text, as LLMEngine with detokenization does: an EOS / stop token adds no
        text, a stop string ends the request at the token that completes it."""
        if out.finish_reason in (None, "length"):
            base = out.num_output_tokens - len(out.token_ids)
            for i, token in enumerate(out.token_ids):
                if req.text.push(token, base + i + 1):
                    keep = i + 1
                    out.token_ids = out.token_ids[:keep]
                    if out.logprobs is not None:
                        out.logprobs = out.logprobs[:keep]
                    if out.logprob_ranks is not None:
                        out.logprob_ranks = out.logprob_ranks[:keep]
                    out.num_output_tokens = base + keep
                    out.finished, out.finish_reason = True, "stop"
                    break
        out.text = req.text.take(out.finished)

