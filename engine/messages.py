"""The typed messages between the front process and the engine core process, and their bytes.

front -> core: `AddRequest`, `AbortRequests`, `Shutdown`.
core -> front: `CoreReady` once loaded, then one `StepOutputs` per step (every request's new
token ids, logprobs, counters and finish state, plus the requests refused or failed), and
`CoreDead` when a fatal error ends it.

Each message is a msgpack array `[tag, *fields]` generic over its dataclass fields (the
transport's measurements and why msgpack: docs/PROCESSES.md). `SamplingParams` travels as
`{field name: value}` over its dataclass fields, so a field added to it crosses without an edit
here; a value msgpack has no type for (a tuple, a set, an enum) travels pickled.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import msgpack

from engine.request import (
    EngineDead,
    EngineOverloaded,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)

_PICKLED = 1  # msgpack ext type code


@dataclass
class AddRequest:
    request_id: str
    prompt: str | None  # for the test-only fault injection marker; the core does not tokenize it
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class CoreReady:
    pid: int
    max_model_len: int


# RequestError.kind -> the exception the front raises in the request's stream
ERRORS = {"invalid": InvalidRequest, "overloaded": EngineOverloaded, "failed": RequestFailed, "dead": EngineDead}


def error_kind(exc: BaseException) -> str:
    return next((kind for kind, cls in ERRORS.items() if isinstance(exc, cls)), "failed")


@dataclass
class RequestError:
    request_id: str
    kind: str  # one of ERRORS
    message: str


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]  # text is empty: the front detokenizes
    errors: list[RequestError] = field(default_factory=list)
    stats: dict | None = None  # the engine's stats, at most every STATS_INTERVAL_S (engine/core_process.py)


@dataclass
class CoreDead:
    reason: str


MESSAGES = [AddRequest, AbortRequests, Shutdown, CoreReady, StepOutputs, CoreDead]
_TAG = {cls: i for i, cls in enumerate(MESSAGES)}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in MESSAGES}
_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _default(obj):
    return msgpack.ExtType(_PICKLED, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: bytes):
    if code == _PICKLED:
        return pickle.loads(data)
    return msgpack.ExtType(code, data)


def _fields_of(msg) -> list:
    if isinstance(msg, AddRequest):
        sp = msg.sampling
        return [msg.request_id, msg.prompt, msg.prompt_token_ids, {n: getattr(sp, n) for n in _SAMPLING_FIELDS}]
    if isinstance(msg, StepOutputs):
        return [[[getattr(o, n) for n in _OUTPUT_FIELDS] for o in msg.outputs],
                [[e.request_id, e.kind, e.message] for e in msg.errors], msg.stats]
    return [getattr(msg, n) for n in _FIELDS[type(msg)]]


def encode(msg) -> bytes:
    return msgpack.packb([_TAG[type(msg)], *_fields_of(msg)], use_bin_type=True, strict_types=True,
                         default=_default)


def decode(data: bytes):
    tag, *values = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    cls = MESSAGES[tag]
    if cls is AddRequest:
        values[3] = SamplingParams(**values[3])
    elif cls is StepOutputs:
        values[0] = [RequestOutput(*row) for row in values[0]]
        values[1] = [RequestError(*row) for row in values[1]]
    return cls(*values)
