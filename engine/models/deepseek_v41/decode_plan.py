"""V4.1's compressor plan for a decode step, built on the device from the batch's own tensors.

A prefill chunk's plan (engine/compress_plan.py) is built on the host from the step's ragged
metadata, and how many blocks it closes varies step to step. A decode step has one row per
sequence, so its plan has a fixed shape: every row gets one block slot. A row whose position
closes a group (position + 1 a multiple of the ratio) writes its block where the sequence's full
table says; every other row (and every padding row) writes the cache's scratch entry. The plan
reads only the batch's positions, state slots and full tables, which a captured decode graph
refreshes by copy, so the same kernels serve any batch of that size: no host value of one step
is baked in.

Source rows follow CompressPlan's convention: [0, T) this step's rows, T + slot * ratio + i row i
of a state slot's open group (`pend_*`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch


@dataclass
class DecodePlan:
    """The CompressPlan fields V4.1's compressors read, with fixed shapes, plus where each block goes."""

    ratio: int
    num_blocks: int  # T: one block slot per row
    src: torch.Tensor  # [T * ratio] the block's rows: the open group's first ratio - 1, then this row
    blk_entry: torch.Tensor  # [T] the block's entry index in its sequence (0 where none closes)
    dst: torch.Tensor  # [T] pool row (block id * entries per block + offset); the scratch entry where none closes
    pend_row: torch.Tensor  # [T] every row
    pend_dst: torch.Tensor  # [T] slot * ratio + position % ratio: its open group; the scratch slot's for a closing row


def decode_plan(fb: ForwardBatch, ratio: int, cache) -> DecodePlan:
    """The plan for ratio `ratio` of a decode batch (one token per sequence, none replayed) over
    `cache` (a V41KVCache: its block size and scratch block / slot)."""
    pos, seq = fb.positions, fb.token_seq
    T = pos.shape[0]
    rows = torch.arange(T, device=pos.device)
    closes = (pos + 1) % ratio == 0
    entry = torch.where(closes, (pos + 1) // ratio - 1, 0)
    per_block = cache.block_size // ratio
    dst = torch.where(closes, fb.full_tables[seq, entry // per_block] * per_block + entry % per_block,
                      cache.scratch_full * per_block)
    slot = fb.state_slot_t[seq]
    i = torch.arange(ratio, device=pos.device)
    # a closing row's group is positions pos - ratio + 1 .. pos: i < ratio - 1 wait in its slot's pend_*
    src = torch.where(i == ratio - 1, rows[:, None], T + slot[:, None] * ratio + i).reshape(-1)
    # a closing row's own projection is not kept (as the host plan: nothing of its group stays open)
    pend_dst = torch.where(closes, cache.scratch_slot, slot) * ratio + pos % ratio
    return DecodePlan(ratio, T, src, entry, dst, rows, pend_dst)
