"""What the runner hands the model for one step: packed tokens of several sequences plus
per-sequence metadata. Built by runner.py, read by model.py; nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] tokens of all sequences, packed
    positions: torch.Tensor  # [T] absolute position of each token
    seq_lens: list[int]  # new tokens per sequence this step
    starts: list[int]  # position of each sequence's first new token
    replay_starts: list[int]  # window attention reads no position below this (bounded replay)
    compress_from: list[int]  # compressors absorb only positions >= this (earlier ones are cached)
    window_slots: torch.Tensor  # [T] block_id * block_size + offset where each token's window KV goes
    window_tables: torch.Tensor  # [S, max blocks] logical window block -> block id (-1: freed or none)
    full_tables: torch.Tensor  # [S, max blocks] logical token block -> compressed-pool block id
    state_slots: list[int]  # per sequence: compressor rolling-state slot
    logits_rows: torch.Tensor  # rows of the packed batch whose logits are wanted
    token_seq: torch.Tensor  # [T] which sequence each token belongs to (kernels read per-token metadata)
    replay_start_t: torch.Tensor  # [S] replay_starts as a tensor
    state_slot_t: torch.Tensor  # [S] state_slots as a tensor
    is_decode: bool  # one new token per sequence, none replayed: the vectorised, sync-free path
    max_pos: int  # the largest position in the batch (host copy: sizes without a device sync)
    plans: dict = field(default_factory=dict)  # per-step index plans, built once, shared by layers
    # speculative decoding: when a dict, each compressor leaves the rows of the blocks it closed
    # here (id(state) -> (kv, gate)), so a block closed by a rejected draft can be reopened
    closed_blocks: dict | None = None
    lookback_ids: torch.Tensor | None = None  # [T, k] the k token ids before each row (V4.1 Engram), -1 none

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


_TENSORS = {f.name for f in fields(ForwardBatch) if f.type == "torch.Tensor"}


@dataclass
class HostBatch:
    """A ForwardBatch's fields as host lists: what the runner packs and tensor-parallel ranks receive."""

    input_ids: list[int]
    positions: list[int]
    seq_lens: list[int]
    starts: list[int]
    replay_starts: list[int]
    compress_from: list[int]
    window_slots: list[int]
    window_tables: list[list[int]]
    full_tables: list[list[int]]
    state_slots: list[int]
    logits_rows: list[int]
    token_seq: list[int]
    replay_start_t: list[int]
    state_slot_t: list[int]
    is_decode: bool
    max_pos: int

    def to_device(self, device: torch.device) -> ForwardBatch:
        return ForwardBatch(**{f.name: torch.tensor(getattr(self, f.name), dtype=torch.long, device=device)
                               if f.name in _TENSORS else getattr(self, f.name) for f in fields(self)})


DEAD = -1  # look-back slot before the sequence start: an n-gram never reaches across it


def lookback_rows(token_ids: list[int], start: int, n: int, k: int) -> torch.Tensor:
    """For positions start..start+n-1 of a sequence: the k token ids before each, nearest first
    (DEAD below 0) -> [n, k]; one slice and a window view, no per-token Python."""
    lo = start - k
    before = [DEAD] * max(0, -lo) + token_ids[max(0, lo):start + n - 1]  # positions lo .. start+n-2
    return torch.tensor(before, dtype=torch.long).unfold(0, k, 1).flip(-1)

