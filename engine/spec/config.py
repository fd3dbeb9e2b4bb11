"""`speculative_config`, vLLM's shape: {"method": "mtp", "num_speculative_tokens": k} or
{"method": "dspark", "num_speculative_tokens": k, "confidence_threshold": c, "min_acceptance_length": L,
"backoff_steps": b, "max_backoff_steps": B} (all optional for dspark: k from the checkpoint's
dspark_block_size, c = 0: verify what the drafter proposes; L, b, B: the acceptance gate of
engine/spec/verify_gate.py, defaults below; docs/DSPARK.md says why).

Checked at the edge (EngineArgs.validate: a bad one is InvalidEngineArgs); LLMEngine parses it
again at start. What depends on the checkpoint (the block size, the compress ratios bounding k)
is checked by the SpecDecoder (engine/spec/decoder.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 16  # a sanity bound: the verify batch and its graphs grow with k + 1
_KEYS = {"mtp": {"method", "num_speculative_tokens"},
         "dspark": {"method", "num_speculative_tokens", "confidence_threshold", "min_acceptance_length",
                    "backoff_steps", "max_backoff_steps"}}
# The acceptance gate's defaults (docs/DSPARK.md): a verify of DSpark's whole block plus its drafter step
# cost (17.08 + 1.98) / 11.80 = 1.6 plain steps at batch 1 (suite dspark, H100, 2026-12-06), so a sequence
# whose verifies emit fewer than 1.6 tokens on average is slower than plain decoding
MIN_ACCEPTANCE_LENGTH = 1.6
BACKOFF_STEPS, MAX_BACKOFF_STEPS = 4, 64  # plain steps before the first probe; doubled per failed probe, capped


def _is(value, types) -> bool:
    """isinstance, but a JSON true / false is no number (bool subclasses int)."""
    return isinstance(value, types) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None  # None: the method's default (dspark: from the checkpoint)
    confidence_threshold: float = 0.0  # dspark: verify the longest prefix predicted accepted at least this likely
    min_acceptance_length: float = MIN_ACCEPTANCE_LENGTH  # dspark: 0 turns the acceptance gate off
    backoff_steps: int = BACKOFF_STEPS
    max_backoff_steps: int = MAX_BACKOFF_STEPS

    @classmethod
    def parse(cls, raw: dict | str | None) -> SpeculativeConfig | None:
        """None / {} -> off. A JSON string is read as vLLM's CLI reads it. ValueError names the problem."""
        if raw is None or raw == {} or raw == "":
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be an object like "
                             f'{{"method": "mtp", "num_speculative_tokens": 1}}, got {raw!r}')
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported; the native engine drafts "
                             f"with the checkpoint's own MTP layer or DSpark stages: method must be one of {list(METHODS)}")
        unknown = sorted(set(raw) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown} for method {method!r}; "
                             f"this engine reads {sorted(_KEYS[method])}")
        k = raw.get("num_speculative_tokens")
        if not (k is None and method == "dspark") and (
                not _is(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        c = raw.get("confidence_threshold", 0.0)
        if not _is(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise ValueError(f"speculative_config: confidence_threshold must be a number in [0, 1], got {c!r}")
        L = raw.get("min_acceptance_length", MIN_ACCEPTANCE_LENGTH)
        if not _is(L, (int, float)) or not 0.0 <= L <= MAX_SPECULATIVE_TOKENS + 1:
            raise ValueError(f"speculative_config: min_acceptance_length must be a number in "
                             f"[0, {MAX_SPECULATIVE_TOKENS + 1}] (tokens per verify; 0: never stop verifying), got {L!r}")
        b = raw.get("backoff_steps", BACKOFF_STEPS)
        if not _is(b, int) or b < 1:
            raise ValueError(f"speculative_config: backoff_steps must be a positive integer, got {b!r}")
        top = raw.get("max_backoff_steps", max(b, MAX_BACKOFF_STEPS))
        if not _is(top, int) or top < b:
            raise ValueError(f"speculative_config: max_backoff_steps must be an integer >= backoff_steps ({b}), "
                             f"got {top!r}")
        return cls(method, k, float(c), float(L), b, top)
