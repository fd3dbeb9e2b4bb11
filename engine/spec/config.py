"""`speculative_config`, vLLM's shape: {"method": "mtp", "num_speculative_tokens": k}.

Checked at the edge (EngineArgs.validate: a bad one is InvalidEngineArgs); LLMEngine parses it
again at start for k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 3  # k + 1 verified positions must not close two blocks of a ratio-4 compressor


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int

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
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}; "
                             "this engine reads method and num_speculative_tokens")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported; the native engine "
                             f"drafts with the checkpoint's own MTP layer: method must be one of {list(METHODS)}")
        k = raw.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        return cls(method, k)
