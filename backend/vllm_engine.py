"""The engine interface (engine/interface.py) over vLLM's `AsyncLLM`: `"engine": "vllm"`.

model.json's other keys are vLLM engine arguments (`AsyncEngineArgs` fields), checked by name
before anything loads. A request maps to one `AsyncLLM.generate()` call with our sampling
parameters as vLLM's (output_kind=DELTA, so each output is what is new); its outputs map back
to our `RequestOutput` deltas. Abort is vLLM's abort (it frees the KV blocks and ends the stream
with finish_reason "abort"). stats() is fed by a vLLM stat logger: vLLM calls it with each
engine core's scheduler stats (running, waiting, KV usage, prefix-cache queries and hits) and
iteration stats (preemptions), the same figures its own Prometheus logger reads.

vLLM is optional: it is imported only when this engine is built (`make setup-vllm`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from engine.interface import SubmitThroughAdd
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger("deepseek.vllm")

HEALTH_INTERVAL_S = 2.0
# Native-engine arguments vLLM does not have, and vLLM's nearest one where it has one.
NATIVE_ONLY_ARGS = {
    "device": None,
    "kernels": None,
    "pdl": None,
    "cudagraph_mode": "compilation_config",
    "max_waiting_requests": "max_num_queued_reqs",
    "max_stop_strings": None,
    "max_stop_string_len": None,
}
# head_dim vLLM's DeepSeek-V4 kernels are built for (attention latent = K = V).
VLLM_DSV4_HEAD_DIM = 512


class InvalidVllmArgs(ValueError):
    pass


def import_vllm() -> None:
    try:
        import vllm  # noqa: F401
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f'model.json says "engine": "vllm", but vLLM cannot be imported in {sys.prefix} ({e}). '
            "Build the vLLM environment (`make setup-vllm`) and serve with its Python: "
            "`.venv-vllm/bin/python -m backend.serve ...` (Triton's stub imports from that venv)."
        ) from e


def engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}


def check_engine_args(args: dict) -> None:
    """Every key must be a vLLM engine argument; say which is not, and what was probably meant."""
    known = engine_arg_names()
    problems = []
    for key in sorted(set(args) - known):
        if key in NATIVE_ONLY_ARGS:
            instead = NATIVE_ONLY_ARGS[key]
            problems.append(f"{key!r} is a native-engine argument" +
                            (f" (vLLM's nearest: {instead!r})" if instead else " (vLLM has none)"))
        else:
            close = difflib.get_close_matches(key, known, n=1)
            problems.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if problems:
        raise InvalidVllmArgs("unknown vLLM engine argument(s) in model.json: " + "; ".join(problems) +
                              ". Keys are vLLM's AsyncEngineArgs fields (`vllm serve --help`, with '-' as '_').")
    _check_not_the_native_tiny_checkpoint(args.get("model"))


def _check_not_the_native_tiny_checkpoint(model: str | None) -> None:
    """The project's tiny DeepSeek-V4 checkpoints are too small for vLLM's V4 kernels: say so up front
    instead of failing deep inside vLLM's model code."""
    try:
        config = json.loads((Path(model or "") / "config.json").read_text())
    except (OSError, ValueError):
        return
    if config.get("model_type") == "deepseek_v4" and config.get("head_dim", VLLM_DSV4_HEAD_DIM) != VLLM_DSV4_HEAD_DIM:
        raise InvalidVllmArgs(
            f"{model} is a DeepSeek-V4 checkpoint with head_dim {config.get('head_dim')}: vLLM's DeepSeek-V4 "
            f"kernels need head_dim {VLLM_DSV4_HEAD_DIM} (the tiny presets are for the native engine). For a "
            "small vLLM model on CPU: python -m tools.make_tiny_vllm_checkpoint DIR")


def to_vllm_sampling(sp: SamplingParams):
    """Our SamplingParams (vLLM's names already) -> vllm.SamplingParams streaming deltas."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        return VllmSamplingParams(
            n=1,
            max_tokens=sp.max_tokens,
            min_tokens=sp.min_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,  # -1: off in every vLLM release (0 only in newer)
            min_p=sp.min_p,
            seed=sp.seed,
            stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None,
            ignore_eos=sp.ignore_eos,
            logprobs=sp.logprobs,
            prompt_logprobs=sp.prompt_logprobs,
            skip_special_tokens=sp.skip_special_tokens,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias={int(t): b for t, b in sp.logit_bias.items()} if sp.logit_bias else None,
            bad_words=list(sp.bad_words) or None,
            allowed_token_ids=sp.allowed_token_ids,
            structured_outputs=_structured_outputs(sp.structured_outputs),
            detokenize=sp.detokenize,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA,
        )
    except Exception as e:  # noqa: BLE001 - vLLM's checks raise ValueError or VLLMValidationError
        raise InvalidRequest(f"invalid sampling parameters for vLLM: {e}") from e


def _structured_outputs(spec: dict | None):
    """Our structured_outputs dict (vLLM's field names) -> vLLM's StructuredOutputsParams."""
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**spec)


class _Stats:
    """What stats() reports, accumulated from vLLM's stat-logger calls (one per engine step)."""

    def __init__(self):
        self.per_engine: dict[int, tuple[int, int, float]] = {}  # engine -> running, waiting, kv usage
        self.prefix_cache_queries = 0
        self.prefix_cache_hit_tokens = 0
        self.num_preemptions = 0

    def record(self, engine_idx: int, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            waiting = scheduler_stats.num_waiting_reqs + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            self.per_engine[engine_idx] = (scheduler_stats.num_running_reqs, waiting, scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats  # this step's lookups, not a running total
            if prefix is not None:
                self.prefix_cache_queries += prefix.queries
                self.prefix_cache_hit_tokens += prefix.hits
        if iteration_stats is not None:
            self.num_preemptions += iteration_stats.num_preempted_reqs

    def as_dict(self) -> dict:
        engines = sorted(self.per_engine.items())
        kv = {"all": engines[0][1][2]} if len(engines) == 1 else {f"dp{i}": v[2] for i, v in engines}
        return {
            "running": sum(v[0] for _, v in engines),
            "waiting": sum(v[1] for _, v in engines),
            "kv_usage": kv,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            # vLLM counts no replayed tokens (its SWA bounded replay, DeepSeek-V4.1 only, exports none)
            "prefix_cache_replayed_tokens": 0,
            "num_preemptions": self.num_preemptions,
        }


def _stat_logger_factory(stats: _Stats):
    """A vLLM per-engine stat logger factory that feeds `stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TritonStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats.record(engine_idx, scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    return TritonStatLogger


def _vllm_errors():
    """vLLM's exception classes by role; absent ones (older releases) match nothing."""
    import vllm.exceptions as vexc
    from vllm.v1.engine import exceptions as engine_exc

    class _Never(Exception):
        pass

    return {
        "client": getattr(vexc, "VLLMClientError", _Never),
        "overloaded": getattr(vexc, "GracefulHTTPError", _Never),
        "dead": getattr(engine_exc, "EngineDeadError", _Never),
        "generate": getattr(engine_exc, "EngineGenerateError", _Never),
    }


class VllmEngine(SubmitThroughAdd):
    """AsyncEngine over vllm.v1.engine.async_llm.AsyncLLM."""

    def __init__(self, engine_args: dict):
        import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = dict(engine_args)
        args.pop("engine", None)
        check_engine_args(args)
        try:
            self.engine_args = AsyncEngineArgs(**args)
        except Exception as e:  # vLLM validates nested configs (compilation_config, ...) here
            raise InvalidVllmArgs(f"vLLM rejected the engine arguments in model.json: {type(e).__name__}: {e}") from e
        self.llm = None
        self._stats = _Stats()
        self._errors = _vllm_errors()
        self._inflight: set[str] = set()
        self._accepting = False
        self._stopped = False
        self._dead: str | None = None
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        # Built on the event loop that will drive it (its output handler and ZMQ sockets live
        # there); this blocks the loop while the engine core loads, as `vllm serve` does.
        try:
            self.llm = AsyncLLM.from_engine_args(self.engine_args,
                                                 stat_loggers=[_stat_logger_factory(self._stats)])
        except Exception as e:
            raise RuntimeError(f"vLLM engine failed to start: {type(e).__name__}: {e}") from e
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_health())
        self._accepting = True

    # --- the interface ------------------------------------------------------------------------

    async def add(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self._dead is not None or (self.llm is not None and self.llm.errored):
            raise EngineDead(f"vLLM engine stopped: {self._dead or 'engine core died'}")
        if not self._accepting:
            raise EngineDead("engine is not accepting requests (starting or shutting down)")
        params = to_vllm_sampling(request.sampling)
        prompt = ({"prompt_token_ids": list(request.prompt_token_ids)} if request.prompt_token_ids is not None
                  else {"prompt": request.prompt})
        rid = request.request_id
        generator = self.llm.generate(prompt, params, rid)
        self._inflight.add(rid)
        num_prompt = num_output = num_cached = 0
        cumulative = 0.0
        started = False
        try:
            while True:
                try:
                    out = await generator.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as e:  # noqa: BLE001 - mapped to our error types
                    raise self._map_error(e, started) from e
                started = True
                completion = out.outputs[0]
                num_prompt = len(out.prompt_token_ids) if out.prompt_token_ids else num_prompt
                num_cached = out.num_cached_tokens or num_cached
                num_output += len(completion.token_ids)
                if completion.cumulative_logprob is not None:
                    cumulative = completion.cumulative_logprob
                logprobs = None
                if request.sampling.logprobs is not None and completion.logprobs is not None:
                    logprobs = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs]
                prompt_logprobs = prompt_ranks = None
                if request.sampling.prompt_logprobs is not None and out.prompt_logprobs:  # the first output's
                    prompt_logprobs = [None if step is None else {int(t): float(lp.logprob) for t, lp in step.items()}
                                       for step in out.prompt_logprobs]  # vLLM puts the prompt token first
                    prompt_ranks = [None if step is None else next(iter(step.values())).rank
                                    for step in out.prompt_logprobs]
                yield RequestOutput(
                    request_id=rid,
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    num_prompt_tokens=num_prompt,
                    num_output_tokens=num_output,
                    num_cached_tokens=num_cached,
                    cumulative_logprob=cumulative,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    prompt_logprob_ranks=prompt_ranks,
                    finished=out.finished,
                    finish_reason=completion.finish_reason if out.finished else None,
                )
                if out.finished:
                    return
        finally:
            self._inflight.discard(rid)
            # An unfinished request whose consumer went away (cancelled, disconnected): closing
            # vLLM's generator aborts it there, which frees its KV blocks.
            await generator.aclose()

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    def stats(self) -> dict:
        return self._stats.as_dict() if self.llm is not None else {}

    def health(self) -> bool:
        return (self.llm is not None and not self._stopped and self._dead is None and not self.llm.errored)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.llm is not None and self._inflight:
            await self.llm.abort(list(self._inflight))
            await asyncio.sleep(0.1)  # let the abort outputs reach their streams
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.llm.shutdown)

    # --- internals -----------------------------------------------------------------------------

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.llm.check_health()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means the engine core is gone
                self._dead = f"{type(e).__name__}: {e}"
                log.error("vLLM engine is not healthy: %s", self._dead)
                return

    def _map_error(self, e: Exception, started: bool) -> Exception:
        errors = self._errors
        if isinstance(e, errors["client"]):
            if getattr(e, "parameter", None) == "input_tokens":  # the prompt does not fit
                return InvalidRequest(f"the prompt does not fit max_model_len={self.engine_args.max_model_len}: {e}")
            return InvalidRequest(str(e))
        if isinstance(e, errors["overloaded"]):
            return EngineOverloaded(getattr(e, "message", None) or str(e))
        if isinstance(e, errors["dead"]):
            self._dead = self._dead or "engine core died"
            return EngineDead(f"vLLM engine stopped: {e}")
        cause = e.__cause__ if isinstance(e, errors["generate"]) and e.__cause__ is not None else e
        if isinstance(cause, (ValueError, TypeError)) and not started:  # vLLM's input checks
            return InvalidRequest(str(cause))
        return RequestFailed(f"vLLM request failed: {type(cause).__name__}: {cause}")
