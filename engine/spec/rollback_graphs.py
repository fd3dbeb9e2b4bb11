"""The speculative step's rollback of the compressors' rolling state, as one CUDA graph per verify bucket.

A verify step of k + 1 rows per sequence may close several blocks per sequence and compressor
(ceil((k + 1) / ratio)); where rejected positions closed some, the first of them (the block
holding the first rejected position) is reopened: its rows go back into the open-block state and
the CSA overlap state is the Ca slice of the block before it (closed by this step, or the state
from before the step). Later blocks hold only rejected positions: nothing reads them until those
positions run again and rewrite them (engine/spec/decoder.py says why that is all the cache
needs). Eagerly that is a handful of indexed copies per compressor and indexer state, so the
host's launch work grows with the depth; after a
pure verify step (a replayed verify graph, whose closed blocks and snapshot sit in VerifyGraphs'
static buffers) the same copies replay as one graph, fed one small index array: per ratio and
batch row, the closed block to reopen, its state slot, its batch index and the closed block before
it (-1: none this step). Rows with nothing to reopen point at the cache's scratch slot, which every
padding row writes anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.graphs.capture import capture, capture_buckets, replay_bucket


def reopen(states, closed: dict, snapshot: dict, m: int, blk, slot, b, prev_blk) -> None:
    """Reopen the ratio-m blocks at closed-block rows `blk` into state slots `slot`, in every
    compressor and indexer state of that ratio. The CSA overlap state becomes the Ca slice of the
    block before the reopened one: closed-block row `prev_blk` when this step closed that block too
    (a verify longer than the ratio), else (prev_blk < 0) the state from before the step, snapshot
    row `b`. closed: id(state) -> (kv, gate) of the step's closed blocks; snapshot: id(state) ->
    (prev_kv, prev_gate, has_prev) by batch index."""
    for st in states:
        if st.pend_kv.shape[1] != m or id(st) not in closed:
            continue
        kv, gate = closed[id(st)]
        st.pend_kv[slot] = kv[blk].to(st.pend_kv.dtype)
        st.pend_gate[slot] = gate[blk].to(st.pend_gate.dtype)
        if st.prev_kv is not None:
            prev_kv, prev_gate, has_prev = snapshot[id(st)]
            hd, here = st.prev_kv.shape[-1], prev_blk >= 0
            j, sel = prev_blk.clamp(min=0), here[:, None, None]
            st.prev_kv[slot] = torch.where(sel, kv[j, :, :hd].to(prev_kv.dtype), prev_kv[b])
            st.prev_gate[slot] = torch.where(sel, gate[j, :, :hd].to(prev_gate.dtype), prev_gate[b])
            st.has_prev[slot] = has_prev[b] | here


@dataclass
class _Bucket:
    B: int
    index: dict[int, tuple[torch.Tensor, ...]]  # ratio -> (blk, slot, b, prev_blk) views of flat
    flat: torch.Tensor  # [ratios, 4, B]
    staging: torch.Tensor  # pinned on CUDA; written and copied only after the step's read-back
    pad: np.ndarray
    graph: torch.cuda.CUDAGraph | None = None


class RollbackGraphs:
    """The rollback after a verify graph, per verify bucket; captured into `pool` when given, else
    run eagerly on the same static index arrays (the CPU)."""

    def __init__(self, verify, pool=None, capture_fn=capture):
        self.verify = verify
        self.ratios = verify.ratios
        self.replays = 0
        self.static: dict[int, _Bucket] = capture_buckets(verify.buckets, self._bucket, self._forward, pool, capture_fn)

    def _bucket(self, B: int) -> _Bucket:
        pad = np.zeros((len(self.ratios), 4, B), dtype=np.int64)
        # scratch slot; the padding sequence's snapshot row; no closed block before
        pad[:, 1], pad[:, 2], pad[:, 3] = self.verify.cache.scratch_slot, B, -1
        flat = torch.from_numpy(pad.copy()).to(self.verify.device)
        index = {m: tuple(flat[i]) for i, m in enumerate(self.ratios)}
        staging = torch.empty(pad.shape, dtype=torch.long, pin_memory=self.verify.device.type == "cuda")
        return _Bucket(B, index, flat, staging, pad)

    def _forward(self, bk: _Bucket) -> None:
        for m, index in bk.index.items():
            reopen(self.verify.states, self.verify.closed, self.verify.snap, m, *index)

    def run(self, batch_size: int, fixes: dict[int, list[tuple[int, int, int, int]]]) -> None:
        """fixes: ratio -> (closed block row, state slot, batch index, closed block row before it or
        -1) of each block to reopen."""
        bk = self.static[self.verify.bucket(batch_size)]
        host = bk.staging.numpy()
        host[:] = bk.pad
        for i, m in enumerate(self.ratios):
            for j, row in enumerate(fixes.get(m, ())):
                host[i, :, j] = row
        self.replays += 1
        replay_bucket(bk, self._forward)
