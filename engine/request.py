"""What crosses the engine boundary: a request in, a stream of outputs back.

Both engines (native, vllm) take a `GenerationRequest` and yield `RequestOutput`
deltas; the Triton side (backend/protocol.py) builds the first and renders the
second, and never knows which engine runs. Names follow vLLM's SamplingParams; field values
stay msgpack-friendly (ints, floats, strings, lists, dicts with string keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily


class InvalidRequest(ValueError):
    """The client's mistake (maps to Triton INVALID_ARG)."""


class EngineOverloaded(RuntimeError):
    """Admission refused: too many waiting requests (maps to UNAVAILABLE)."""


class EngineDead(RuntimeError):
    """The engine hit a fatal error and serves nothing more (maps to UNAVAILABLE)."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine; others carry on (maps to INTERNAL)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (vLLM uses -1)
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per output token; None: off
    prompt_logprobs: int | None = None  # top-n logprobs per prompt position (plus the prompt token); None: off
    skip_special_tokens: bool = True
    # penalties, as vLLM (OpenAI's presence / frequency; repetition counts the prompt too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit, clamped to [-100, 100]; string keys (JSON's, msgpack-safe)
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words (its tokenizer)
    allowed_token_ids: list[int] | None = None
    # vLLM's structured_outputs: one of {"json": schema, "regex": str, "choice": [str], "grammar": ebnf,
    # "json_object": true}, plus "disable_any_whitespace"; compiled by the engine (engine/structured_output.py)
    structured_outputs: dict | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: as many as max_model_len allows
    detokenize: bool = True  # False: token ids only (no text, so no stop strings)
    # vLLM applies it in its slow-tokenizer path only; a tokenizers (fast) tokenizer, as here, ignores it
    spaces_between_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        # below vLLM's _SAMPLING_EPS a temperature would overflow float32 logits: greedy, as vLLM
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def processes_with_history(self) -> bool:
        """Changes the logits by the values of the tokens generated so far, read on the host (a bad word of several
        tokens, a grammar): the sampler needs the previous step's token there (async scheduling reads that step back
        first; a one-token bad word is always banned, and the penalties only count tokens, which the device does)."""
        return any(len(w) > 1 for w in self.bad_words_token_ids or []) or self.structured_outputs is not None

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalty: the logits change by the counts of tokens seen."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature / top-k / top-p / min-p that changes the logits."""
        return bool(self.penalized or self.logit_bias or self.bad_words_token_ids or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)


@dataclass
class GenerationRequest:
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestOutput:
    """One delta of one request. `text`/`token_ids`/`logprobs` are new since the last delta;
    the counters are cumulative. The last delta has `finished=True` and a `finish_reason`
    ("stop", "length" or "abort")."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # finish_reason "error": why this request alone failed (its sampling)
    logprob_ranks: list[int | None] | None = None  # with logprobs: each sampled token's rank over the vocabulary
    # with prompt_logprobs, in the request's first output only: one entry per prompt token, None for
    # the first (vLLM's), else {token id: logprob} with the prompt token first, then its rank
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # time.monotonic() when the request was first scheduled; one host-wide clock, so the front
    # (another process) measures vLLM's queue / prefill / inference times against it
    scheduled_time: float | None = None


def merge_outputs(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: what a consumer that fell behind receives, so
    it handles (renders, sends) one delta per request per turn instead of one per token. New
    text, tokens and logprobs are joined; the counters and the finish come from the last."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = ranks = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    if any(d.logprob_ranks is not None for d in deltas):
        ranks = [r for d in deltas for r in d.logprob_ranks or ()]
    prompt = next((d for d in deltas if d.prompt_logprobs is not None), last)  # the first delta carries them
    return replace(last, text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
                   logprobs=logprobs, logprob_ranks=ranks, prompt_logprobs=prompt.prompt_logprobs,
                   prompt_logprob_ranks=prompt.prompt_logprob_ranks)
