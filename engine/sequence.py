"""One request inside the engine: its tokens, progress and cache blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.cache import SeqBlocks
from engine.request import SamplingParams

# An output token sampled by a step still on the GPU (async scheduling): the next step reads
# it on the device; the engine writes the real id in when the step's results are read back.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # time.monotonic() when first scheduled (vLLM's queue / prefill times)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, taken from the prefix cache
    replay_start: int = 0  # window attention reads no position below this (bounded replay)
    compress_from: int = 0  # tokens below this are already absorbed by the compressors
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    registered_blocks: int = 0  # full blocks already in the prefix cache's hash table
    pending_restore: bool = False  # a prefix-cache hit waits for its state to be restored
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # speculative decoding: drafts for the next step
    grammar: object | None = None  # structured outputs: its xgrammar matcher (state follows output_token_ids)
    prompt_logprobs_next: int = 1  # prompt_logprobs: the next prompt position to score (kept across preemption)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def has_pending_token(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
