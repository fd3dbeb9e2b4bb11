"""TritonPythonModel for the `deepseek` python-based backend: requests in, streamed responses out.

Threads, no model logic:
- Triton's execute thread parses each request (backend/protocol.py) and starts it with
  `engine.submit`, which returns at once: the native engine's core client queues it for its
  admission thread, which tokenizes it (without the GIL) and sends it to the engine core. Triton
  calls execute once at a time per model instance, so every millisecond spent here delays the
  next arrival;
- the thread that delivers the engine's deltas (the core client's reader thread, which reads each
  step's outputs from the core; the model's asyncio event loop for engines that only have
  `add`) hands each request's deltas (streaming) or its one rendered response (_Delivery) to
- the response threads, the only ones that touch response senders after admission: they render
  and send (a request's deltas that piled up meanwhile as one response), one request on one
  thread at a time so its responses stay in order; the first also polls `is_cancelled()` so a
  cancelled request is aborted in the engine (freeing its cache).
The event loop (its own thread) still runs the engine's start, stats, aborts and shutdown.

Every error message starts with its Triton code ("UNAVAILABLE: engine overloaded: ..."): Triton
2.51's HTTP generate endpoints answer 400 for any error a decoupled model sends, and errors inside
a gRPC stream carry only the message, so the message is the one place a client finds the code.
Prompt text is logged only with `"enable_log_requests": true` in model.json.
"""

from __future__ import annotations

import asyncio
import functools
import json
import locale
import os
import queue
import signal
import struct
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import protocol, stub_numpy
from backend.engine_setup import (
    build_engine,
    drained_marker,
    finalize_marker,
    load_engine_args,
    pop_backend_options,
)
from backend.metrics import Metrics, RequestRecord, TokenTimes, scheduling_times
from engine import hop_trace
from engine.os_threads import named
from engine.request import EngineDead, EngineOverloaded, InvalidRequest, RequestFailed, merge_outputs

# The stub's embedded interpreter starts in the C locale (ASCII text files); take the environment's
# (backend.serve sets a UTF-8 one), as a `python` process would.
try:
    locale.setlocale(locale.LC_CTYPE, "")
except locale.Error:  # the environment names a locale this system lacks: keep C
    pass

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_LENGTH = struct.Struct("<I")


def _serialize_byte_tensor(tensor, _general=pb_utils.serialize_byte_tensor):
    """pb_utils.Tensor serializes a BYTES array by calling this module function: Triton's walks
    the elements with np.nditer, about 20 us per tensor. Every BYTES output here holds one bytes
    object (2 per streamed response), which takes one struct.pack; the rest goes the general way."""
    if tensor.dtype == np.object_ and tensor.size == 1:
        item = tensor.item()
        if type(item) is bytes:
            return _LENGTH.pack(len(item)) + item
    return _general(tensor)


pb_utils.serialize_byte_tensor = _serialize_byte_tensor
# A send releases the GIL while Triton's process takes the response, and must win it back from the
# threads with Python work (the engine's event loop, the core client's reader): Python hands it over
# only every switch interval (5 ms by default). Beside a busy thread one sender managed 290-410
# responses/s, against 4,800-6,600 alone; four senders at a 0.5 ms interval 3,900-4,900
# (suite response_sends, 2-core CPU machine).
RESPONSE_THREADS = 4
GIL_SWITCH_INTERVAL_S = 0.0005
CANCEL_POLL_S = 0.1  # how often in-flight requests are checked for client cancellation
DRAIN_TIMEOUT_S = 30.0  # finalize: how long in-flight requests may run on
DRAINED_SEND_S = 5.0  # after the drain: how long the final responses may take to go out
PARENT_POLL_S = 1.0
PROMPT_BYTES_PER_TOKEN = 128  # far above any tokenizer's average: a bound, not an estimate


class _Delivery:
    """One request's deltas from the engine (engine/interface.py's DeltaSink), on the thread that
    delivers them: the core client's reader thread, which reads each step's outputs and hands them
    on here at once, or the model's event loop for engines that deliver through `add`. Streamed
    deltas go to the response threads; the end of the request (its last delta or its failure)
    queues the response that closes it and records its metrics."""

    def __init__(self, model: TritonPythonModel, stream: _ResponseStream, parsed: protocol.ParsedRequest,
                 arrival: float):
        self.model, self.stream, self.parsed, self.arrival = model, stream, parsed, arrival
        request = parsed.request
        stream.state = protocol.OutputState(request.prompt, parsed.exclude_input_in_output, parsed.returns,
                                            id=parsed.id, decode_token=model.decode_token)
        self.last = self.scheduled_at = None
        self.times = TokenTimes()
        self.aborted = False
        self.closed = False

    def output(self, delta) -> None:
        model, stream = self.model, self.stream
        self.last = delta
        stream.started = True
        self.scheduled_at = self.scheduled_at or delta.scheduled_time  # the engine's, on the same host clock
        starts_response = True
        if stream.cancelled:
            if not self.aborted:  # the response thread aborts too; this covers a cancel before admission
                self.aborted = True
                model._abort(stream.request_id)
        elif self.parsed.stream:
            starts_response = model._queue_delta(stream, delta)
        else:
            stream.state.accumulate(delta)
        if delta.token_ids:
            self.times.arrived(time.monotonic(), starts_response)
        if delta.finished:
            self._end()

    def _end(self) -> None:
        model, stream, last = self.model, self.stream, self.last
        try:
            if stream.cut_off:
                model._queue_error(stream, stream.cut_off, "UNAVAILABLE")
            elif stream.cancelled:  # counted once: as request_success_total{finished_reason="abort"}
                model._queue_error(stream, "request cancelled", "CANCELLED", count=False)
            elif not self.parsed.stream:
                model._queue(stream, protocol.render_final(stream.state, last), final=True)
        except Exception as e:  # a bug in rendering fails this request only
            self._internal_error(e)
        finally:
            self._close()

    def failed(self, error: BaseException) -> None:
        if self.closed:  # its end is queued already
            return
        model, stream = self.model, self.stream
        try:
            if isinstance(error, InvalidRequest):
                model._queue_error(stream, str(error), "INVALID_ARG")
            elif isinstance(error, EngineOverloaded):
                model._queue_error(stream, f"engine overloaded: {error}", "UNAVAILABLE")
            elif isinstance(error, EngineDead):
                model._queue_error(stream, f"engine dead: {error}", "UNAVAILABLE")
                model._healthy()
            elif isinstance(error, RequestFailed):
                model._queue_error(stream, f"request failed: {error}", "INTERNAL")
            elif isinstance(error, asyncio.CancelledError):
                model._queue_error(stream, "the server is shutting down", "UNAVAILABLE")
            else:
                self._internal_error(error)
        finally:
            self._close()

    def _internal_error(self, error: BaseException) -> None:
        self.model.logger.log_error(f"[deepseek] request {self.stream.request_id} failed: "
                                    f"{''.join(traceback.format_exception(error))}")
        self.model._queue_error(self.stream, f"internal error: {type(error).__name__}: {error}", "INTERNAL")

    def _close(self) -> None:
        """Once per request, however it ended (a failure after its end changes nothing more)."""
        if self.closed:
            return
        self.closed = True
        model, last = self.model, self.last
        model._count_active(-1)
        if model.metrics is not None and last is not None and last.finished:
            first, latest, now = self.times.first, self.times.last, time.monotonic()
            model.metrics.record(RequestRecord(
                num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
                finish_reason=last.finish_reason or "unknown",
                ttft_s=None if first is None else first - self.arrival,
                e2e_s=now - self.arrival,
                decode_s=None if first is None else latest - first,
                itl_s=self.times.gaps, max_tokens=self.parsed.request.sampling.max_tokens,
                **scheduling_times(self.arrival, self.scheduled_at, first, latest)))


@dataclass(eq=False)
class _ResponseStream:
    """One admitted request, as the response thread sees it."""

    sender: object
    request_id: str
    stream: bool
    cancelled: bool = False
    final_sent: bool = False
    state: protocol.OutputState | None = None  # streaming: rendering state (the response threads')
    deltas: list = field(default_factory=list)  # streaming: engine deltas not yet sent
    last: tuple | None = None  # (response, flags) that ends the request, sent after its deltas
    queued: bool = False  # in the response queue, or a response thread is sending for it
    started: bool = False  # the engine sent its first delta (prefill done)
    cut_off: str | None = None  # why the shutdown drain ended it (UNAVAILABLE)
    # held while its sender talks to Triton: a cancellation check racing the final response would
    # reach Triton after it freed the request's response factory (tritonserver died of SIGSEGV)
    sender_lock: threading.Lock = field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "the deepseek backend needs model_transaction_policy { decoupled: true } in config.pbtxt")

        check_stub_numpy()
        _exit_with_parent()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # this process is the stub: ours alone

        model_json = os.path.join(args["model_repository"], args["model_version"], "model.json")
        engine_args = load_engine_args(model_json)
        self.logger.log_info(f"[deepseek] engine arguments: {json.dumps(engine_args)}")
        options = pop_backend_options(engine_args)
        self.log_requests = bool(options["enable_log_requests"])
        self.shutdown_file = options["shutdown_file"]
        self.max_model_len = engine_args.get("max_model_len")
        self.max_prompt_bytes = int(options["max_prompt_bytes"] or
                                    PROMPT_BYTES_PER_TOKEN * (self.max_model_len or 1 << 17))
        response_threads = options["response_threads"] or RESPONSE_THREADS
        if not isinstance(response_threads, int) or response_threads < 1:
            raise pb_utils.TritonModelException(f"model.json: response_threads must be an integer >= 1, "
                                                f"not {response_threads!r}")

        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=named("ds-loop", self.loop.run_forever), name="deepseek-engine",
                                            daemon=True)
        self.loop_thread.start()
        try:
            self.engine = build_engine(engine_args)
            self._on_loop(self.engine.start())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join()
            raise
        # logprobs' decoded_token (vllm_backend's field): one token's text, cached per id
        tokenizer = getattr(self.engine, "tokenizer", None)
        self.decode_token = None if tokenizer is None else functools.lru_cache(maxsize=1 << 16)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False))

        self.num_active = 0  # requests admitted and not yet finished; read by finalize
        self.active_lock = threading.Lock()  # num_active: counted up on execute, down where deltas arrive
        self._engine_stopping: asyncio.Future | None = None  # the engine's shutdown, once started
        self.stopping = False
        self.unloading = False
        self.streams: set[_ResponseStream] = set()
        self.streams_lock = threading.Lock()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()  # _ResponseStream with something to send
        self.deltas_lock = threading.Lock()  # a stream's deltas, last and queued
        # each response thread's own counters, summed for metrics (stream_*_total, response_thread_cpu_seconds_total)
        self.thread_stats = [{"stream_deltas": 0, "stream_responses": 0, "response_thread_cpu_s": 0.0}
                             for _ in range(response_threads)]
        self.response_threads = [threading.Thread(target=named(f"ds-responses-{i}", self._response_loop),
                                                  args=(stats, i == 0),
                                                  name=f"deepseek-responses-{i}", daemon=True)
                                 for i, stats in enumerate(self.thread_stats)]
        for thread in self.response_threads:
            thread.start()

        self.metrics = None
        if _config_flag(self.model_config, "REPORT_CUSTOM_METRICS"):
            labels = {"model": self.model_name, "version": args["model_version"]}
            self.metrics = Metrics(labels, self._engine_stats, self.max_model_len or 1 << 17,
                                   model_name=self.model_name)
            self.metrics.start()
        self.logger.log_info(f"[deepseek] {engine_args.get('engine')} engine ready: {engine_args.get('model')}")

    # ---------------------------------------------------------------- Triton execute thread

    def execute(self, requests):
        for request in requests:
            arrival = time.monotonic()
            sender = request.get_response_sender()
            if self.stopping or not self._healthy():
                self._send_now(sender, "the model is unavailable: the engine is not healthy or shutting down",
                               "UNAVAILABLE")
                continue
            try:
                request_id = protocol.engine_request_id(request.request_id(), uuid.uuid4().hex[:12])
            except InvalidRequest as e:
                self._send_now(sender, str(e), "INVALID_ARG")
                continue
            # one pass over the inputs Triton checked against config.pbtxt (get_input_tensor_by_name
            # walks them all again for each name)
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            try:
                parsed = protocol.parse_request(inputs, request.parameters(), request_id, self.max_prompt_bytes)
            except InvalidRequest as e:
                self._send_now(sender, str(e), "INVALID_ARG")
                continue
            except Exception as e:  # a bug in parsing must not take the execute thread down
                self.logger.log_error(f"[deepseek] parsing request {request_id} failed: {traceback.format_exc()}")
                self._send_now(sender, f"internal error: {type(e).__name__}: {e}", "INTERNAL")
                continue
            if self.log_requests:
                self.logger.log_info(f"[deepseek] request {request_id}: stream={parsed.stream} "
                                     f"sampling={parsed.request.sampling} prompt={parsed.request.prompt!r}")
            hop_trace.mark(request_id, "execute", t=arrival)
            stream = _ResponseStream(sender, request_id, parsed.stream)
            with self.streams_lock:
                self.streams.add(stream)
            self._count_active(1)
            delivery = _Delivery(self, stream, parsed, arrival)
            try:
                self.engine.submit(parsed.request, delivery, self.loop)
            except Exception as e:  # a bug on the way in fails this request only
                delivery.failed(e)
        return None

    def _abort(self, request_id: str) -> None:
        """From any thread: stop the request in the engine (frees its cache)."""
        asyncio.run_coroutine_threadsafe(self.engine.abort(request_id), self.loop)

    def _count_active(self, change: int) -> None:
        with self.active_lock:
            self.num_active += change

    # ---------------------------------------------------------------- engine deltas (_Delivery)

    def _queue_delta(self, stream: _ResponseStream, delta) -> bool:
        """Streamed deltas are rendered and sent by the response threads. A render costs about
        100 us of Python (tools.profile_serving), under the GIL the reader and the other senders
        also need: when the threads fall behind (many streams, fast steps), the deltas that piled up
        for a request go out as one response, so the work scales with requests rather than tokens.
        True when `delta` starts a response, False when it joins one still waiting for a thread."""
        hop_trace.mark(stream.request_id, "handed", delta.num_output_tokens)
        with self.deltas_lock:
            stream.deltas.append(delta)
            if stream.queued:
                return False
            stream.queued = True
        self.responses.put(stream)
        return True

    def _queue_last(self, stream: _ResponseStream, response, flags: int = FINAL) -> None:
        """The response that ends a request (an error, a non-streaming request's one response):
        sent after the deltas queued before it, by the thread that holds the stream."""
        with self.deltas_lock:
            stream.last = (response, flags)
            if stream.queued:
                return
            stream.queued = True
        self.responses.put(stream)

    def _queue(self, stream: _ResponseStream, tensors: dict, final: bool) -> None:
        self._queue_last(stream, _response(tensors), FINAL if final else 0)

    def _queue_error(self, stream: _ResponseStream, message: str, code: str, count: bool = True) -> None:
        self._queue_last(stream, self._error_response(message, code, count))

    def _send_now(self, sender, message: str, code: str) -> None:
        """Refuse a request on the execute thread (before it reaches the engine)."""
        try:
            sender.send(self._error_response(message, code), flags=FINAL)
        except Exception:
            self.logger.log_error(f"[deepseek] sending an error failed: {traceback.format_exc()}")

    def _error_response(self, message: str, code: str, count: bool = True):
        """`code`: a pb_utils.TritonError code name; it also leads the message (see the docstring).
        `count`: false when the request is counted already (an abort the engine finished)."""
        if self.metrics is not None and count:
            self.metrics.record_error(code)
        error = pb_utils.TritonError(f"{code}: {message}", getattr(pb_utils.TritonError, code))
        return pb_utils.InferenceResponse(error=error)

    # ---------------------------------------------------------------- response thread

    @property
    def response_stats(self) -> dict:
        return {name: sum(stats[name] for stats in self.thread_stats) for name in self.thread_stats[0]}

    def _response_loop(self, stats: dict, polls: bool):
        """`polls`: this thread also checks for cancelled requests and the shutdown file."""
        next_poll = time.monotonic() + CANCEL_POLL_S if polls else float("inf")
        while True:
            try:
                stream = self.responses.get(timeout=max(0.0, next_poll - time.monotonic()) if polls else None)
            except queue.Empty:
                stream = ...
            if stream is None:
                return
            cpu = time.thread_time()
            if stream is not ...:
                self._send_stream(stream, stats)
            if time.monotonic() >= next_poll:
                self._poll_cancelled()
                self._poll_shutdown()
                next_poll = time.monotonic() + CANCEL_POLL_S
            stats["response_thread_cpu_s"] += time.thread_time() - cpu

    def _send_stream(self, stream: _ResponseStream, stats: dict) -> None:
        """Send what `stream` has pending; the stream stays this thread's (queued) meanwhile, and
        goes back to the queue if more came in."""
        with self.deltas_lock:
            deltas, stream.deltas, last, stream.last = stream.deltas, [], stream.last, None
        if deltas:
            self._send_deltas(stream, deltas, stats)
        if last is not None:
            self._send(stream, *last)
        with self.deltas_lock:
            stream.queued = bool(stream.deltas or stream.last)
        if stream.queued:
            self.responses.put(stream)

    def _send_deltas(self, stream: _ResponseStream, deltas: list, stats: dict) -> None:
        stats["stream_deltas"] += len(deltas)
        stats["stream_responses"] += 1
        delta = merge_outputs(deltas)
        final = delta.finished
        try:
            response = _response(protocol.render_delta(stream.state, delta))
        except Exception as e:  # a bug in rendering fails this request only
            self.logger.log_error(f"[deepseek] rendering a response of {stream.request_id} failed: "
                                  f"{traceback.format_exc()}")
            response, final = self._error_response(f"internal error: {type(e).__name__}: {e}", "INTERNAL"), True
            stream.cancelled = True  # the rest of its stream is dropped: free its cache
            self._abort(stream.request_id)
        self._send(stream, response, FINAL if final else 0, delta.num_output_tokens)

    def _send(self, stream: _ResponseStream, response, flags, tokens: int = 0) -> None:
        with stream.sender_lock:
            if stream.final_sent:
                return
            hop_trace.mark(stream.request_id, "send_began", tokens)
            try:
                stream.sender.send(response, flags=flags)
            except Exception:
                self.logger.log_error(f"[deepseek] sending a response failed: {traceback.format_exc()}")
            hop_trace.mark(stream.request_id, "sent", tokens)
            if flags & FINAL:
                stream.final_sent = True
        if flags & FINAL:
            hop_trace.done(stream.request_id)
            with self.streams_lock:
                self.streams.discard(stream)

    def _poll_cancelled(self) -> None:
        with self.streams_lock:
            streams = [f for f in self.streams if not f.cancelled]
        for stream in streams:
            if not stream.sender_lock.acquire(blocking=False):  # sending now: checked next time
                continue
            try:
                cancelled = not stream.final_sent and stream.sender.is_cancelled()
            except Exception:
                cancelled = False
            finally:
                stream.sender_lock.release()
            if cancelled:
                self.logger.log_info(f"[deepseek] request {stream.request_id} cancelled by the client")
                stream.cancelled = True
                self._abort(stream.request_id)

    def _poll_shutdown(self) -> None:
        """Triton counts a decoupled model's open streams as neither in-flight inferences nor
        anything it could cut off: on SIGTERM it just waits, up to its exit timeout, for the model
        to go idle, and calls finalize only after. So backend.serve first writes the drain deadline
        (wall-clock seconds) into `shutdown_file`; seen here, admission stops, the requests in flight
        run on until the deadline, and those still running then end with UNAVAILABLE. Requests
        still waiting for their prefill end with UNAVAILABLE at once: a client can retry them on
        another server, and they could not finish in a drain anyway."""
        if self.stopping or not self.shutdown_file:
            return
        try:
            with open(self.shutdown_file) as f:
                deadline = float(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        self.stopping = True
        remaining = max(0.0, deadline - time.time())
        self.logger.log_info(f"[deepseek] shutting down: {self.num_active} requests in flight get {remaining:.1f} s")
        asyncio.run_coroutine_threadsafe(self._drain(time.monotonic() + remaining), self.loop)

    async def _drain(self, deadline: float) -> None:
        await self._cut_off(lambda stream: not stream.started,
                            "the server is shutting down; this request had not started (safe to retry)")
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self._cut_off(lambda stream: True, "the server is shutting down and the drain timeout cut this request off")
        final_sent_by = time.monotonic() + DRAINED_SEND_S
        while self.streams and time.monotonic() < final_sent_by:
            await asyncio.sleep(0.05)
        await self._stop_engine()
        self._mark_drained()

    async def _stop_engine(self) -> None:
        """The engine's shutdown, once, whoever asks first: the drain (nothing is left for it) or
        finalize. The drain does it because finalize may never come: Triton 2.51 can keep a
        reference to the model after gRPC streams end (docs/RELIABILITY.md), and then waits out
        its exit timeout without calling finalize."""
        if self._engine_stopping is None:
            self._engine_stopping = asyncio.ensure_future(self.engine.shutdown(drain_timeout_s=DRAIN_TIMEOUT_S))
        await asyncio.shield(self._engine_stopping)

    def _mark_drained(self) -> None:
        """Tell backend.serve that nothing is in flight and the engine is stopped: if Triton has not
        called finalize and exited shortly after, the launcher ends it (backend/serve.py `stop`)."""
        self.logger.log_info(f"[deepseek] drained: {len(self.streams)} streams open, engine stopped")
        self._write_marker(drained_marker)

    def _write_marker(self, marker) -> None:
        """A file beside the shutdown file, for backend.serve: when it appeared says what is over."""
        if not self.shutdown_file:
            return
        path = marker(self.shutdown_file)
        try:
            path.write_text(f"{time.time():.3f}\n")
        except OSError as e:
            self.logger.log_error(f"[deepseek] could not write {path}: {e}")

    async def _cut_off(self, which, reason: str) -> None:
        with self.streams_lock:
            streams = [s for s in self.streams if not s.final_sent and not s.cut_off and which(s)]
        for stream in streams:
            stream.cut_off, stream.cancelled = reason, True
            await self.engine.abort(stream.request_id)

    # ---------------------------------------------------------------- health, stats, shutdown

    def _healthy(self) -> bool:
        """Engine health; once it fails, unload the model so that Triton's model (and server)
        readiness says so (needs --model-control-mode=explicit, which backend.serve uses)."""
        if self.engine.health():
            return True
        if getattr(self.engine, "restarting", False):  # the engine core process comes back by itself
            return False
        if not self.unloading and not self.stopping:  # finalize shuts the engine down on purpose
            self.unloading = True
            self.logger.log_error("[deepseek] the engine is not healthy; unloading the model")
            try:
                pb_utils.unload_model(self.model_name)
            except Exception as e:
                self.logger.log_error(f"[deepseek] could not unload the model: {e}")
        return False

    def _engine_stats(self) -> dict:
        """Called from the metrics thread: read stats on the loop, and check health meanwhile."""
        self._healthy()
        return {**self._on_loop(_call(self.engine.stats), timeout=5.0), **self.response_stats}

    def _on_loop(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def finalize(self):
        self.logger.log_info(f"[deepseek] finalize: draining {self.num_active} in-flight requests")
        self._write_marker(finalize_marker)  # Triton let go of the model: backend.serve waits for its exit
        self.stopping = True
        try:
            self._on_loop(self._stop_engine(), timeout=DRAIN_TIMEOUT_S + 30)
        except Exception:
            self.logger.log_error(f"[deepseek] engine shutdown failed: {traceback.format_exc()}")
        deadline = time.monotonic() + 10
        while self.num_active > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.metrics is not None:
            self.metrics.stop()
        for _ in self.response_threads:
            self.responses.put(None)
        for thread in self.response_threads:
            thread.join(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
        self.logger.log_info("[deepseek] finalize: done")


def check_stub_numpy() -> None:
    """Refuse numpy 2 under a stub that corrupts BYTES tensors with it (Triton <= 2.51: the server
    would say ready, then fail every request "Stub process is not healthy"). A BYTES round trip
    inside the stub does not show the corruption (tried on the H200: it passed, then requests
    failed), so the rule is checked: this stub's Triton version (its TRITON_VERSION file, which
    NVIDIA's images and backend.serve's layout have) against the numpy it imported."""
    stub = Path(os.path.realpath("/proc/self/exe"))
    triton = stub_numpy.triton_version(stub, None)
    if stub_numpy.corrupts_bytes(np.__version__, triton):
        raise pb_utils.TritonModelException(
            f"numpy {np.__version__} under Triton {'.'.join(map(str, triton))}'s python backend stub, which corrupts "
            f"BYTES tensors with numpy 2: {stub_numpy.NUMPY_FIX}")


def _exit_with_parent() -> None:
    """A stub outlives a crashed tritonserver (re-parented, holding its memory and, on a GPU host, GPU
    memory, deaf to SIGTERM): this thread ends the stub once its parent is gone."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="deepseek-parent-watch", daemon=True).start()


def _response(tensors: dict):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()])


async def _call(fn):
    return fn()


def _config_flag(model_config: dict, name: str) -> bool:
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    return value.strip().lower() in ("true", "yes", "1", "on")
