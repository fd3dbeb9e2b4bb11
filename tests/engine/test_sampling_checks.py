"""The sampling values are checked once, by the engine (engine/sampling_checks.py), against the
engine arguments' limits; the protocol only parses names and types (tests/backend/test_protocol.py)."""

import pytest

from backend.protocol import parse_sampling
from engine.llm import LLM
from engine.request import InvalidRequest, SamplingParams
from engine.sampling_checks import RequestLimits, sampling_checks

LIMITS = RequestLimits(max_model_len=128, vocab_size=1000, max_logprobs=20, max_stop_strings=16,
                       max_stop_string_len=256)


def first_failure(raw: dict, limits: RequestLimits = LIMITS) -> str | None:
    """The message the engine refuses vLLM-named sampling parameters with (None: accepted)."""
    return next((msg for ok, msg in sampling_checks(parse_sampling(raw), limits) if not ok), None)


@pytest.mark.parametrize("raw, message", [
    ({"max_tokens": -1}, "max_tokens must be between 1 and 128"),
    ({"max_tokens": 0}, "max_tokens must be between 1 and 128"),
    ({"max_tokens": 10**12}, "max_tokens must be between 1 and 128"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -5}, "top_k must be"),
    ({"min_p": 2}, "min_p must be in"),
    ({"min_tokens": 99, "max_tokens": 4}, "min_tokens must be between 0 and max_tokens"),
    ({"seed": -3}, "seed must be a non-negative"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be between 0 and 20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
    ({"stop_token_ids": [1000]}, "stop_token_ids must be token ids in [0, 1000)"),
    ({"stop": ["x" * 257]}, "stop strings must be 1..256 characters"),
])
def test_bad_values_name_the_problem(raw, message):
    assert message in (first_failure(raw) or "")


def test_good_values_pass():
    assert first_failure({"max_tokens": 128, "min_tokens": 128, "temperature": 0, "top_p": 1, "top_k": -1,
                          "min_p": 0, "seed": 0, "logprobs": 20, "stop": ["a"] * 16, "stop_token_ids": [999]}) is None


def test_the_limits_come_from_the_engine_arguments():
    """One source: model.json's max_logprobs / max_stop_strings (engine/args.py's defaults)."""
    assert "between 0 and 20" in first_failure({"logprobs": 21})
    assert "at most 16" in first_failure({"stop": [f"s{i}" for i in range(17)]})
    raised = RequestLimits(128, 1000, max_logprobs=50, max_stop_strings=32, max_stop_string_len=256)
    assert first_failure({"logprobs": 50, "stop": [f"s{i}" for i in range(32)]}, raised) is None
    assert "between 0 and 50" in first_failure({"logprobs": 51}, raised)


def test_the_engine_refuses_at_admission_with_its_own_limits(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64, max_logprobs=3)
    assert llm.engine.limits.max_model_len == 64 and llm.engine.limits.max_logprobs == 3
    for sp, message in [(SamplingParams(max_tokens=65), "max_tokens must be between 1 and 64"),
                        (SamplingParams(logprobs=4), "logprobs must be between 0 and 3"),
                        (SamplingParams(seed=1 << 63), "seed must be a non-negative")]:
        with pytest.raises(InvalidRequest, match=message):
            llm.generate(["Hello"], sp)
    assert not llm.engine.has_unfinished()  # nothing of a refused request is left behind
