"""Where each compressor input goes in one step, for every sequence at once.

A prefill chunk (or a mixed prefill + decode step) closes many ratio-token blocks across many
sequences. Each closed block's rows come partly from this step's projections and partly from
the sequence's open block in the rolling state (`pend_*`). The runner's host metadata
(positions, starts, compress_from) says exactly which, so the plan is built on the host once
per ratio per step and copied to the device in one transfer: the compressors then gather,
pool and scatter every sequence in a fixed number of torch ops, with no per-sequence loop
and no host sync.

Indices into the "source" rows: [0, T) are this step's packed rows; T + slot * ratio + i is
row i of a state slot's open block (pend_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch


@dataclass
class CompressPlan:
    ratio: int
    num_blocks: int  # blocks closed this step, all sequences
    src: torch.Tensor  # [num_blocks * ratio] source row of each closed block's rows
    blk_seq: torch.Tensor  # [num_blocks] batch index of the block's sequence
    blk_entry: torch.Tensor  # [num_blocks] entry index (block number) within its sequence
    prev: torch.Tensor  # [num_blocks] CSA overlap source: slot s -> state slot s, S + j -> block j of this step
    bnd_blk: torch.Tensor  # blocks (into this step's) ending on a full cache block: prefix-cache state
    bnd_seq: torch.Tensor  # their sequences' batch index
    bnd_logical: torch.Tensor  # and the full cache block (logical) they end
    upd_slot: torch.Tensor  # state slots whose last closed block changed
    upd_blk: torch.Tensor  # that last closed block (into this step's)
    pend_row: torch.Tensor  # this step's rows left in an open block
    pend_dst: torch.Tensor  # their place in pend_*: slot * ratio + position % ratio


def compress_plan(fb: ForwardBatch, ratio: int, block_size: int, num_slots: int) -> CompressPlan:
    """Built once per (step, ratio) and kept on the batch: every compressor of that ratio shares it."""
    key = ("compress", ratio)
    if key not in fb.plans:
        fb.plans[key] = _build(fb, ratio, block_size, num_slots)
    return fb.plans[key]


def _build(fb: ForwardBatch, m: int, bs: int, num_slots: int) -> CompressPlan:
    T = sum(fb.seq_lens)
    src, blk_seq, blk_entry, prev = [], [], [], []
    bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst = [], [], [], [], [], [], []
    row0 = 0
    for s, n in enumerate(fb.seq_lens):
        start, cfrom, slot = fb.starts[s], fb.compress_from[s], fb.state_slots[s]
        end = start + n
        if cfrom < end:
            first_closed, last_closed = cfrom // m, end // m  # closed blocks: [first_closed, last_closed)
            for b in range(first_closed, last_closed):
                j = len(blk_seq)
                for q in range(b * m, (b + 1) * m):  # rows before cfrom wait in the open block
                    src.append(row0 + q - start if q >= cfrom else T + slot * m + q % m)
                blk_seq.append(s)
                blk_entry.append(b)
                prev.append(slot if b == first_closed else num_slots + j - 1)
                if ((b + 1) * m) % bs == 0:
                    bnd_blk.append(j)
                    bnd_seq.append(s)
                    bnd_logical.append((b + 1) * m // bs - 1)
            if last_closed > first_closed:
                upd_slot.append(slot)
                upd_blk.append(len(blk_seq) - 1)
            for q in range(max(cfrom, last_closed * m), end):
                pend_row.append(row0 + q - start)
                pend_dst.append(slot * m + q % m)
        row0 += n
    parts = [src, blk_seq, blk_entry, prev, bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst]
    flat = torch.tensor([v for p in parts for v in p], dtype=torch.long)
    if fb.input_ids.is_cuda:
        flat = flat.pin_memory().to(fb.input_ids.device, non_blocking=True)
    t = flat.split([len(p) for p in parts])
    return CompressPlan(m, len(blk_seq), *t)
