"""Where each compressor input goes in one step, for every sequence at once.

A prefill chunk (or a mixed prefill + decode step) closes many ratio-token blocks across many
sequences. Each closed block's rows come partly from this step's projections and partly from
the sequence's open block in the rolling state (`pend_*`). The runner's host metadata
(positions, starts, compress_from) says exactly which, so the plan is built on the host once
per ratio per step (in numpy, every sequence at once) and copied to the device in one
transfer: the compressors then gather, pool and scatter every sequence in a fixed number of
torch ops, with no per-sequence loop and no host sync.

Indices into the "source" rows: [0, T) are this step's packed rows; T + slot * ratio + i is
row i of a state slot's open block (pend_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    """Built once per (step, ratio) and kept on the batch: every compressor of that ratio shares it.
    (A CUDA-graph batch carries its plans already, padded to fixed sizes: engine/graphs/mixed.py.)"""
    key = ("compress", ratio)
    if key not in fb.plans:
        parts = plan_arrays(np.asarray(fb.seq_lens), np.asarray(fb.starts), np.asarray(fb.compress_from),
                            np.asarray(fb.state_slots), ratio, block_size, num_slots, sum(fb.seq_lens))
        flat = torch.from_numpy(np.concatenate(parts))
        if fb.input_ids.is_cuda:
            flat = flat.pin_memory().to(fb.input_ids.device, non_blocking=True)
        fb.plans[key] = CompressPlan(ratio, len(parts[1]), *flat.split([len(p) for p in parts]))
    return fb.plans[key]


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of `counts[i]` items: each item's run i and its index within the run."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def plan_arrays(seq_lens: np.ndarray, starts: np.ndarray, compress_from: np.ndarray, state_slots: np.ndarray,
                m: int, bs: int, num_slots: int, num_rows: int) -> list[np.ndarray]:
    """The plan's index arrays (CompressPlan's field order from `src`), every sequence at once in
    numpy. num_rows: the step's packed rows (pend_* source rows start after them)."""
    n, start, slot = (a.astype(np.int64) for a in (seq_lens, starts, state_slots))
    cfrom = np.maximum(compress_from.astype(np.int64), start)
    end, row0 = start + n, np.cumsum(n) - n
    active = cfrom < end
    first, last = cfrom // m, end // m  # closed blocks: [first, last)
    nb = np.where(active, last - first, 0)
    blk_seq, within = _ragged(nb)
    blk_entry = first[blk_seq] + within
    j = np.arange(len(blk_seq))
    q = (blk_entry[:, None] * m + np.arange(m)).reshape(-1)  # each closed block's positions
    qs = np.repeat(blk_seq, m)
    src = np.where(q >= cfrom[qs], row0[qs] + q - start[qs], num_rows + slot[qs] * m + q % m)  # older rows wait in pend_*
    prev = np.where(within == 0, slot[blk_seq], num_slots + j - 1)
    bnd = ((blk_entry + 1) * m) % bs == 0
    has = nb > 0
    upd_slot, upd_blk = slot[has], (np.cumsum(nb) - 1)[has]
    p_lo = np.maximum(cfrom, last * m)
    pend_seq, pend_i = _ragged(np.where(active, end - p_lo, 0))
    pq = p_lo[pend_seq] + pend_i
    pend_row, pend_dst = row0[pend_seq] + pq - start[pend_seq], slot[pend_seq] * m + pq % m
    return [src, blk_seq, blk_entry, prev, j[bnd], blk_seq[bnd], ((blk_entry + 1) * m // bs - 1)[bnd],
            upd_slot, upd_blk, pend_row, pend_dst]
