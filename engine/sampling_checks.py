"""Every check of a request's sampling values (vLLM's rules), in one place, against one set of
limits (the engine arguments and the model), and bad words' tokens.

Checked at admission (LLMEngine.validate), so a bad value is the client's INVALID_ARG and never
reaches a step. The fronts (backend/protocol.py, the OpenAI API) only parse: types and names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.request import SamplingParams
from engine.tokenizer import Tokenizer

MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default


def _token_ids(keys) -> list[int] | None:
    try:
        return [int(k) for k in keys]
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class RequestLimits:
    """What bounds a request: the engine arguments (model.json, vLLM's names) and the model."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_len: int


def sampling_checks(p: SamplingParams, limits: RequestLimits) -> list[tuple[bool, str]]:
    """(ok, message) pairs; LLMEngine.validate raises InvalidRequest with the first failing message."""
    bias_ids = _token_ids(p.logit_bias or {})
    vocab_size, n = limits.vocab_size, limits.max_model_len
    return [
        (1 <= p.max_tokens <= n, f"max_tokens must be between 1 and {n} (max_model_len), got {p.max_tokens}"),
        (0 <= p.min_tokens <= p.max_tokens,
         f"min_tokens must be between 0 and max_tokens ({p.max_tokens}), got {p.min_tokens}"),
        (p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, f"top_k must be -1 or 0 (disabled) or a positive integer, got {p.top_k}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.logprobs is None or 0 <= p.logprobs <= limits.max_logprobs,
         f"logprobs must be between 0 and {limits.max_logprobs} (max_logprobs), got {p.logprobs}"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= limits.max_logprobs,
         f"prompt_logprobs must be between 0 and {limits.max_logprobs} (max_logprobs), got {p.prompt_logprobs}"),
        (len(p.stop) <= limits.max_stop_strings,
         f"stop has {len(p.stop)} strings; at most {limits.max_stop_strings} (max_stop_strings)"),
        (all(0 < len(s) <= limits.max_stop_string_len for s in p.stop),
         f"stop strings must be 1..{limits.max_stop_string_len} characters"),
        (p.seed is None or 0 <= p.seed < 1 << 63, f"seed must be a non-negative 64-bit integer, got {p.seed}"),
        (all(0 <= t < vocab_size for t in p.stop_token_ids),
         f"stop_token_ids must be token ids in [0, {vocab_size}), got {p.stop_token_ids}"),
        (-2 <= p.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2 <= p.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0,
         f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}"),
        (bias_ids is not None, "logit_bias keys must be token ids (integers)"),
        (bias_ids is None or all(0 <= t < vocab_size for t in bias_ids),
         f"logit_bias has token ids outside the vocabulary [0, {vocab_size})"),
        (all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
             for b in (p.logit_bias or {}).values()), "logit_bias values must be finite numbers"),
        (p.allowed_token_ids is None or len(p.allowed_token_ids) > 0, "allowed_token_ids must not be empty"),
        (all(0 <= t < vocab_size for t in p.allowed_token_ids or ()),
         f"allowed_token_ids has token ids outside the vocabulary [0, {vocab_size})"),
        (all(isinstance(w, str) and w for w in p.bad_words), "bad_words cannot contain an empty string"),
        (len(p.bad_words) <= MAX_BAD_WORDS, f"at most {MAX_BAD_WORDS} bad_words"),
        (p.truncate_prompt_tokens is None or p.truncate_prompt_tokens == -1 or p.truncate_prompt_tokens >= 1,
         f"truncate_prompt_tokens must be -1 or >= 1, got {p.truncate_prompt_tokens}"),
        (p.detokenize or not p.stop, "stop strings need detokenize=true (without it no text is made)"),
        (p.structured_outputs is None or not p.ignore_eos,
         "ignore_eos cannot be combined with structured_outputs (a grammar ends the output with EOS)"),
    ]


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's update_from_tokenizer: each word as tokenized at the start of a text and, when that
    gives a different first token of the same length, after a space (mid-text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out
