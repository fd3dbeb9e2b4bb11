"""DSpark's drafter after a pure verify step as one CUDA graph per verify bucket.

After a verify step that replayed a verify graph (engine/spec/verify_graphs.py), DSpark's work has
a fixed shape per bucket of B sequences:

- the keys of the step's rows: every verify row's target features (the verify's shared buffer) at
  its position (the verify bucket's own positions) through the main projection and every stage's
  wkv / kv_norm / RoPE, written into the proposer's key ring (engine/spec/dspark.py) at a row the
  host chose: the ring row of its position for the accepted rows of a speculating sequence, the
  scratch slot's for every other row (rejected drafts, plain decodes, padding);
- one block per batch row from the ring (DSparkDrafter.draft_from_ring: the slot, the block's first
  position and its first token; padding and rows that do not draft read the scratch slot at
  position 0, every context key masked): the three stages, the HC head, the LM head, the Markov
  head's sequential argmax and the confidence head's verify length, all on the device.

The host decides what the eager path decides (who drafts, whose window is complete, which rows are
accepted) and packs it into one small array; one copy, one replay, then the host does the step's
scheduler and output work while it runs, then one read-back of [B, block + 1]: each row's drafts
and its verify length. On the CPU the same function runs eagerly on the static buffers (the tests
compare it with the eager proposer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.graphs.capture import capture, capture_buckets, replay_bucket
from engine.spec.dspark import DSparkProposer
from engine.spec.verify_graphs import VerifyGraphs

_FIELDS = ("ring_rows", "slots", "starts", "last_tokens")  # ring_rows: one per verify row; the others one per batch row


@dataclass
class _Bucket:
    B: int
    T: int  # the verify bucket's rows
    fields: dict[str, tuple[int, int]]  # name -> (offset, length) in flat
    flat: torch.Tensor
    staging: torch.Tensor  # pinned on CUDA; packed only after the previous step's read-back
    pad: np.ndarray
    graph: torch.cuda.CUDAGraph | None = None

    def view(self, name: str) -> torch.Tensor:
        o, n = self.fields[name]
        return self.flat[o:o + n]


class DSparkGraphs:
    def __init__(self, proposer: DSparkProposer, model, verify: VerifyGraphs, pool=None, capture_fn=capture):
        if verify.features is None:
            raise ValueError("DSpark's graphs read the verify graphs' target features: build them with features=True")
        self.proposer, self.model, self.verify = proposer, model, verify
        self.block = proposer.drafter.cfg.dspark.block_size
        self.replays = 0
        B = max(verify.buckets, default=0)
        # shared by every bucket: each row's drafts, then its verify length
        self.out = torch.zeros(B, self.block + 1, dtype=torch.long, device=verify.device)
        self.static: dict[int, _Bucket] = capture_buckets(verify.buckets, self._bucket, self._forward, pool, capture_fn)

    def _bucket(self, B: int) -> _Bucket:
        p, T = self.proposer, self.verify.static[B].T
        fields, at = {}, 0
        for name, n in zip(_FIELDS, (T, B, B, B)):
            fields[name], at = (at, n), at + n
        pad = np.zeros(at, dtype=np.int64)  # starts and tokens 0
        for name, v in (("ring_rows", p.scratch * p.window), ("slots", p.scratch)):
            o, n = fields[name]
            pad[o:o + n] = v
        flat = torch.from_numpy(pad.copy()).to(self.verify.device)
        staging = torch.empty(at, dtype=torch.long, pin_memory=self.verify.device.type == "cuda")
        return _Bucket(B, T, fields, flat, staging, pad)

    def _forward(self, bk: _Bucket) -> None:
        p, drafter = self.proposer, self.proposer.drafter
        drafter.write_context(self.model, p.ring, self.verify.features[:bk.T], self.verify.static[bk.B].fb.positions,
                              bk.view("ring_rows"))
        d = drafter.draft_from_ring(self.model, p.ring, bk.view("slots"), bk.view("starts"), bk.view("last_tokens"),
                                    p.threshold)
        self.out[:bk.B, :self.block].copy_(d.tokens)
        self.out[:bk.B, self.block].copy_(d.verify_len)

    def launch(self, batch, items, where, drafting) -> Callable[[], list[list[int]]]:
        """items, where: engine/spec/decoder.py's _catch_up (each item's batch index and first verify
        row); drafting: its _wanted. Pack, one copy, replay (or run the static batch eagerly, on the
        CPU). -> read(): each drafting sequence's drafts (waits for the replay)."""
        bk = self.static[self.verify.bucket(len(batch))]
        host = bk.staging.numpy()
        host[:] = bk.pad
        col = lambda name: host[bk.fields[name][0]:bk.fields[name][0] + bk.fields[name][1]]
        ring_rows = col("ring_rows")
        for (_, row0), r in zip(where, self.proposer.new_rows(items)):
            ring_rows[row0 + r.first:row0 + r.first + len(r.ring_rows)] = r.ring_rows
        ready = self.proposer.ready(items, drafting)
        at = [where[drafting[r.index][0]][0] for r in ready]  # each ready sequence's batch index
        for name, attr in zip(_FIELDS[1:], ("slot", "start", "last_token")):
            col(name)[at] = [getattr(r, attr) for r in ready]
        self.replays += 1
        replay_bucket(bk, self._forward)

        def read() -> list[list[int]]:
            if not ready:
                return [[] for _ in drafting]
            out = self.out[:bk.B].tolist()
            return self.proposer.take(drafting, ready, [out[b][:self.block] for b in at],
                                      [out[b][self.block] for b in at])
        return read
