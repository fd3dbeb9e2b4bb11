"""engine/messages.py: every message survives its bytes, and SamplingParams crosses over its
dataclass fields, whatever they are (a field added to it needs no edit in the transport)."""

from __future__ import annotations

import dataclasses
import enum

from engine import messages
from engine.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreReady,
    RequestError,
    Shutdown,
    StepOutputs,
)
from engine.request import InvalidRequest, RequestOutput, SamplingParams


class Color(enum.Enum):
    RED = "red"


def _non_default(f: dataclasses.Field, i: int):
    """A value for field `f` that differs from its default and needs msgpack's fallback where it can."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7 + i
    if isinstance(default, float):
        return default + 0.25
    if isinstance(default, list):
        return [f"s{i}", "t"] if "stop" in f.name or "word" in f.name else [3, 4]
    if isinstance(default, dict):
        return {5: -1.5}
    return (i, Color.RED)  # None or anything else: a tuple of an enum travels pickled, exactly


def test_every_sampling_field_crosses_unchanged():
    fields = dataclasses.fields(SamplingParams)
    sp = SamplingParams(**{f.name: _non_default(f, i) for i, f in enumerate(fields)})
    back = messages.decode(messages.encode(AddRequest("r1", "a prompt", [1, 2, 3], sp)))
    assert back == AddRequest("r1", "a prompt", [1, 2, 3], sp)
    for f in fields:
        assert type(getattr(back.sampling, f.name)) is type(getattr(sp, f.name)), f.name


def test_step_outputs_and_control_messages_round_trip():
    out = RequestOutput("r", token_ids=[9], num_prompt_tokens=4, num_output_tokens=1, cumulative_logprob=-0.5,
                        logprobs=[{9: -0.5, 2: -1.25}], finished=True, finish_reason="length",
                        prompt_logprobs=[None, {3: -2.0, 1: -0.5}], prompt_logprob_ranks=[None, 4])
    step = StepOutputs([out, RequestOutput("q", token_ids=[1], num_output_tokens=3)],
                       [RequestError("x", "invalid", "the prompt is empty")], {"running": 2, "kv_usage": {"window": 0.5}})
    for msg in (step, AbortRequests(["a", "b"]), Shutdown(), CoreReady(123, 512), CoreDead("boom")):
        assert messages.decode(messages.encode(msg)) == msg
    assert messages.error_kind(InvalidRequest("x")) == "invalid" and messages.error_kind(ValueError()) == "failed"
