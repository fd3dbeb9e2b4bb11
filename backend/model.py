"""TritonPythonModel for the `deepseek` python-based backend: requests in, streamed responses out.

Three threads, no model logic:
- Triton's execute thread parses each request (backend/protocol.py) and hands it to
- the engine's asyncio event loop (its own thread), which runs `engine.add` per request and
  queues rendered responses for
- the response thread, the only one that touches response senders after admission: it sends,
  and polls `is_cancelled()` so a cancelled request is aborted in the engine (freeing its cache).
"""

from __future__ import annotations

import asyncio
import json
import locale
import os
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from backend import protocol
from backend.engine.request import EngineDead, EngineOverloaded, InvalidRequest, RequestFailed
from backend.engines import build_engine, load_engine_args
from backend.metrics import Metrics, RequestRecord

# The stub's embedded interpreter starts in the C locale (ASCII text files); take the environment's
# (backend.serve sets a UTF-8 one), as a `python` process would.
try:
    locale.setlocale(locale.LC_CTYPE, "")
except locale.Error:  # the environment names a locale this system lacks: keep C
    pass

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.1  # how often in-flight requests are checked for client cancellation
DRAIN_TIMEOUT_S = 30.0  # finalize: how long in-flight requests may run on


@dataclass(eq=False)
class _Flight:
    """One admitted request, as the response thread sees it."""

    sender: object
    request_id: str
    stream: bool
    cancelled: bool = False
    final_sent: bool = False


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                "the deepseek backend needs model_transaction_policy { decoupled: true } in config.pbtxt")

        model_json = os.path.join(args["model_repository"], args["model_version"], "model.json")
        engine_args = load_engine_args(model_json)
        self.max_model_len = engine_args.get("max_model_len")
        self.logger.log_info(f"[deepseek] engine arguments: {json.dumps(engine_args)}")

        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="deepseek-engine", daemon=True)
        self.loop_thread.start()
        try:
            self.engine = build_engine(engine_args)
            self._on_loop(self.engine.start())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join()
            raise

        self.inflight = 0  # requests admitted and not yet finished; read by finalize
        self.stopping = False
        self.unloading = False
        self.flights: set[_Flight] = set()
        self.flights_lock = threading.Lock()
        self.responses: queue.Queue = queue.Queue()
        self.response_thread = threading.Thread(target=self._response_loop, name="deepseek-responses",
                                                daemon=True)
        self.response_thread.start()

        self.metrics = None
        if _config_flag(self.model_config, "REPORT_CUSTOM_METRICS"):
            labels = {"model": self.model_name, "version": args["model_version"]}
            self.metrics = Metrics(labels, self._engine_stats, self.max_model_len or 1 << 17)
            self.metrics.start()
        self.logger.log_info(f"[deepseek] {engine_args.get('engine')} engine ready: {engine_args.get('model')}")

    # ---------------------------------------------------------------- Triton execute thread

    def execute(self, requests):
        for request in requests:
            arrival = time.monotonic()
            sender = request.get_response_sender()
            if self.stopping or not self._healthy():
                _send_error(sender, "the model is unavailable: the engine is not healthy or shutting down",
                            pb_utils.TritonError.UNAVAILABLE)
                continue
            request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
            inputs = {}
            for name in protocol.INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                parsed = protocol.parse_request(inputs, request.parameters(), request_id, self.max_model_len)
            except InvalidRequest as e:
                _send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
                continue
            flight = _Flight(sender, request_id, parsed.stream)
            with self.flights_lock:
                self.flights.add(flight)
            asyncio.run_coroutine_threadsafe(self._generate(flight, parsed, arrival), self.loop)
        return None

    # ---------------------------------------------------------------- engine event loop

    async def _generate(self, flight: _Flight, parsed: protocol.ParsedRequest, arrival: float):
        self.inflight += 1
        request = parsed.request
        state = protocol.OutputState(request.prompt, parsed.exclude_input_in_output, parsed.returns)
        last = None
        first_token_at = None
        aborted = False
        try:
            async for delta in self.engine.add(request):
                last = delta
                if first_token_at is None and delta.token_ids:
                    first_token_at = time.monotonic()
                if flight.cancelled:
                    if not aborted:  # the response thread aborts too; this covers a cancel before add
                        aborted = True
                        await self.engine.abort(request.request_id)
                    continue
                if parsed.stream:
                    self._queue(flight, protocol.render_delta(state, delta), final=delta.finished)
                else:
                    state.accumulate(delta)
            if flight.cancelled:
                self._queue_error(flight, "request cancelled", pb_utils.TritonError.CANCELLED)
            elif last is None or not last.finished:
                self._queue_error(flight, "the engine ended the request without a final output",
                                  pb_utils.TritonError.INTERNAL)
            elif not parsed.stream:
                self._queue(flight, protocol.render_final(state, last), final=True)
        except InvalidRequest as e:
            self._queue_error(flight, str(e), pb_utils.TritonError.INVALID_ARG)
        except EngineOverloaded as e:
            self._queue_error(flight, f"engine overloaded: {e}", pb_utils.TritonError.UNAVAILABLE)
        except EngineDead as e:
            self._queue_error(flight, f"engine dead: {e}", pb_utils.TritonError.UNAVAILABLE)
            self._healthy()
        except RequestFailed as e:
            self._queue_error(flight, f"request failed: {e}", pb_utils.TritonError.INTERNAL)
        except asyncio.CancelledError:
            self._queue_error(flight, "the server is shutting down", pb_utils.TritonError.UNAVAILABLE)
            raise
        except Exception as e:
            self.logger.log_error(f"[deepseek] request {request.request_id} failed: {traceback.format_exc()}")
            self._queue_error(flight, f"internal error: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
        finally:
            self.inflight -= 1
            if self.metrics is not None and last is not None and last.finished:
                now = time.monotonic()
                self.metrics.record(RequestRecord(
                    num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
                    finish_reason=last.finish_reason or "unknown",
                    ttft_s=None if first_token_at is None else first_token_at - arrival,
                    e2e_s=now - arrival,
                    decode_s=None if first_token_at is None else now - first_token_at))

    def _queue(self, flight: _Flight, tensors: dict, final: bool) -> None:
        outputs = [pb_utils.Tensor(name, array) for name, array in tensors.items()]
        self.responses.put((flight, pb_utils.InferenceResponse(output_tensors=outputs), FINAL if final else 0))

    def _queue_error(self, flight: _Flight, message: str, code) -> None:
        error = pb_utils.TritonError(message, code)
        self.responses.put((flight, pb_utils.InferenceResponse(error=error), FINAL))

    # ---------------------------------------------------------------- response thread

    def _response_loop(self):
        next_poll = time.monotonic() + CANCEL_POLL_S
        while True:
            try:
                item = self.responses.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ...
            if item is None:
                return
            if item is not ...:
                self._send(*item)
            if time.monotonic() >= next_poll:
                self._poll_cancelled()
                next_poll = time.monotonic() + CANCEL_POLL_S

    def _send(self, flight: _Flight, response, flags) -> None:
        if flight.final_sent:
            return
        try:
            flight.sender.send(response, flags=flags)
        except Exception:
            self.logger.log_error(f"[deepseek] sending a response failed: {traceback.format_exc()}")
        if flags & FINAL:
            flight.final_sent = True
            with self.flights_lock:
                self.flights.discard(flight)

    def _poll_cancelled(self) -> None:
        with self.flights_lock:
            flights = [f for f in self.flights if not f.cancelled]
        for flight in flights:
            try:
                cancelled = flight.sender.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                self.logger.log_info(f"[deepseek] request {flight.request_id} cancelled by the client")
                flight.cancelled = True
                asyncio.run_coroutine_threadsafe(self.engine.abort(flight.request_id), self.loop)

    # ---------------------------------------------------------------- health, stats, shutdown

    def _healthy(self) -> bool:
        """Engine health; once it fails, unload the model so that Triton's model (and server)
        readiness says so (needs --model-control-mode=explicit, which backend.serve uses)."""
        if self.engine.health():
            return True
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
        return self._on_loop(_call(self.engine.stats), timeout=5.0)

    def _on_loop(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def finalize(self):
        self.logger.log_info(f"[deepseek] finalize: draining {self.inflight} in-flight requests")
        self.stopping = True
        try:
            self._on_loop(self.engine.shutdown(drain_timeout_s=DRAIN_TIMEOUT_S), timeout=DRAIN_TIMEOUT_S + 30)
        except Exception:
            self.logger.log_error(f"[deepseek] engine shutdown failed: {traceback.format_exc()}")
        deadline = time.monotonic() + 10
        while self.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.metrics is not None:
            self.metrics.stop()
        self.responses.put(None)
        self.response_thread.join(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
        self.logger.log_info("[deepseek] finalize: done")


async def _call(fn):
    return fn()


def _send_error(sender, message: str, code) -> None:
    response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
    sender.send(response, flags=FINAL)


def _config_flag(model_config: dict, name: str) -> bool:
    value = model_config.get("parameters", {}).get(name, {}).get("string_value", "")
    return value.strip().lower() in ("true", "yes", "1", "on")
