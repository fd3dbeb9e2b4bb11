"""What the front forwards to Triton, bounded: a request over a limit is a 400 naming its field
before anything is sent (a 16 MiB body of stop_token_ids used to travel as a 24 MB tensor, and
the stub's shared memory grew for good to take it).

Two checks. `check_fields` runs on the parsed body before the request model sees it: only the
lengths of the list fields, so a body of millions of entries costs no validation and no copy.
`check_forwarded` runs on what would be sent: the sampling parameters' JSON against the wire's
cap, the prompt against the model's. The limits are the engine's own (engine/args.py,
engine/sampling_checks.py, backend/protocol.py, backend/model.py); the front imports none of
them (they pull in torch), tests/backend/test_openai_units.py holds them equal."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.openai.errors import bad_request

MAX_SAMPLING_BYTES = 64 << 10  # backend/protocol.py MAX_JSON_BYTES: Triton refuses a larger sampling_parameters
MAX_STOP_TOKEN_IDS = 256  # backend/protocol.py
MAX_BAD_WORDS = 128  # engine/sampling_checks.py (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_STOP_STRINGS = 16  # engine/args.py defaults, unless model.json says otherwise
MAX_STOP_STRING_LEN = 256
PROMPT_BYTES_PER_TOKEN = 128  # backend/model.py: max_prompt_bytes' default per token of max_model_len
# a list can hold no more entries than this and still fit the wire's cap (each takes two bytes or more)
MAX_LIST_ENTRIES = MAX_SAMPLING_BYTES // 2


@dataclass(frozen=True)
class ForwardLimits:
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    max_prompt_tokens: int | None = None  # the engine's max_model_len, when model.json sets it
    max_prompt_bytes: int | None = None  # the model's text_input cap

    @classmethod
    def from_model_json(cls, path: str | Path | None) -> ForwardLimits:
        """The limits of the model Triton serves (its model.json; absent keys: the engine's defaults)."""
        if not path:
            return cls()
        args = json.loads(Path(path).read_text())
        max_model_len = args.get("max_model_len")
        prompt_bytes = args.get("max_prompt_bytes") or (PROMPT_BYTES_PER_TOKEN * max_model_len if max_model_len else None)
        return cls(int(args.get("max_stop_strings") or MAX_STOP_STRINGS),
                   int(args.get("max_stop_string_len") or MAX_STOP_STRING_LEN),
                   int(max_model_len) if max_model_len else None, int(prompt_bytes) if prompt_bytes else None)

    def list_caps(self) -> dict[str, int]:
        """Body field -> most entries it may hold."""
        return {"stop": self.max_stop_strings, "stop_token_ids": MAX_STOP_TOKEN_IDS, "bad_words": MAX_BAD_WORDS,
                "logit_bias": MAX_LIST_ENTRIES, "allowed_token_ids": MAX_LIST_ENTRIES,
                "guided_choice": MAX_LIST_ENTRIES}


def check_fields(body: dict, limits: ForwardLimits) -> None:
    """The body's list fields against their caps (lengths only: no entry is looked at but stop's)."""
    for name, cap in limits.list_caps().items():
        value = body.get(name)
        if isinstance(value, list | dict) and len(value) > cap:
            raise bad_request(f"{name} has {len(value)} entries; at most {cap}", name)
    stop = body.get("stop")
    for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
        if isinstance(s, str) and len(s) > limits.max_stop_string_len:
            raise bad_request(f"stop strings must be at most {limits.max_stop_string_len} characters, got one of "
                              f"{len(s)}", "stop")
    prompt = body.get("prompt")  # a token-id prompt (or a batch of them), checked before it is copied
    if limits.max_prompt_tokens and isinstance(prompt, list):
        for ids in [prompt] if prompt and isinstance(prompt[0], int) else prompt:
            if isinstance(ids, list) and len(ids) > limits.max_prompt_tokens:
                raise bad_request(f"the prompt has {len(ids)} tokens; at most {limits.max_prompt_tokens} "
                                  "(max_model_len)", "prompt")


def check_forwarded(prompt: str | list[int], sampling_json: str, sampling: dict, limits: ForwardLimits) -> None:
    """What one Triton request would carry, against the model's caps; the largest sampling field
    is named when their JSON is over the wire's cap (a schema, a bias table)."""
    if len(sampling_json) > MAX_SAMPLING_BYTES:
        sizes = {name: len(json.dumps(value)) for name, value in sampling.items()}
        largest = max(sizes, key=sizes.get)
        raise bad_request(f"the sampling parameters are {len(sampling_json)} bytes of JSON, at most "
                          f"{MAX_SAMPLING_BYTES}; the largest is {largest} ({sizes[largest]} bytes)", largest)
    if isinstance(prompt, str):
        size = len(prompt.encode("utf-8"))
        if limits.max_prompt_bytes and size > limits.max_prompt_bytes:
            raise bad_request(f"the prompt is {size} bytes; at most {limits.max_prompt_bytes} (max_prompt_bytes)",
                              "prompt")
    elif limits.max_prompt_tokens and len(prompt) > limits.max_prompt_tokens:
        raise bad_request(f"the prompt has {len(prompt)} tokens; at most {limits.max_prompt_tokens} (max_model_len)",
                          "prompt")
