"""DSpark's drafter after a graphed step as CUDA graphs, per bucket of the step's graphs.

After a step that replayed a graph leaving the target features (a verify graph,
engine/spec/verify_graphs.py, or a plain decode step's, engine/spec/plain_graphs.py: the step's
`source`), DSpark's work has a fixed shape per bucket of B sequences:

- the keys of the step's rows: every row's target features (the source's shared buffer) at its
  position (the source bucket's own positions) through the main projection and every stage's
  wkv / kv_norm / RoPE, written into the proposer's key ring (engine/spec/dspark.py) at a row the
  host chose: the ring row of its position for the accepted rows of a speculating sequence, the
  scratch slot's for every other row (rejected drafts, plain decodes, padding);
- one block per batch row from the ring (DSparkDrafter.draft_from_ring: the slot, the block's first
  position and its first token; padding and rows that do not draft read the scratch slot at
  position 0, every context key masked): the three stages, the HC head, the LM head, the Markov
  head's sequential argmax and the verify length (the confidence head's, 0 where even the first
  draft is predicted below the threshold: engine/spec/dspark.py), all on the device.

Each bucket has two graphs: keys and blocks, and the keys alone (a step after which no sequence
drafts: the acceptance gate's back-off keeps the ring current at the cost of a few projections,
not the three stages). The host decides what the eager path decides (who drafts, whose window is
complete, which rows are accepted) and packs it into one small array; one copy, one replay, then
the host does the step's scheduler and output work while it runs, then one read-back of
[B, block + 1]: each row's drafts and its verify length. On the CPU the same functions run eagerly
on the static buffers (the tests compare them with the eager proposer). A keys-only replay may
follow a step that stays in flight (async scheduling: nothing is read back), so alternate replays
pack alternate staging buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.graphs.capture import capture, capture_buckets, replay_bucket
from engine.graphs.staging import StagingPair
from engine.spec.dspark import DSparkProposer, gated_lengths

_FIELDS = ("ring_rows", "slots", "starts", "last_tokens")  # ring_rows: one per source row; the others one per batch row


@dataclass
class _Bucket:
    B: int
    T: int  # the source bucket's rows
    fields: dict[str, tuple[int, int]]  # name -> (offset, length) in flat
    flat: torch.Tensor
    stagings: StagingPair  # pinned on CUDA
    pad: np.ndarray
    graph: torch.cuda.CUDAGraph | None = None  # keys and blocks
    keys_only: _KeysOnly | None = None  # the same static batch, keys only

    @property
    def staging(self) -> torch.Tensor:
        return self.stagings.current

    def view(self, name: str) -> torch.Tensor:
        o, n = self.fields[name]
        return self.flat[o:o + n]


@dataclass
class _KeysOnly:
    """A bucket's keys-only graph: the full bucket's static batch (its flat and staging)."""
    full: _Bucket
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def flat(self) -> torch.Tensor:
        return self.full.flat

    @property
    def staging(self) -> torch.Tensor:
        return self.full.staging


class DSparkGraphs:
    def __init__(self, proposer: DSparkProposer, model, source, pool=None, capture_fn=capture):
        """source: the graphs of the step before (VerifyGraphs with features, or PlainStepGraphs):
        its `features`, `buckets`, `bucket()`, `device`, and per bucket `static[B].T` rows at
        `static[B].fb.positions`."""
        if source.features is None:
            raise ValueError("DSpark's graphs read the step's target features: build the verify graphs with features=True")
        self.proposer, self.model, self.source = proposer, model, source
        self.block = proposer.drafter.cfg.dspark.block_size
        self.replays = 0
        self.keys_replays = 0  # of them, keys only (no sequence drafted)
        B = max(source.buckets, default=0)
        # shared by every bucket: each row's drafts, then its verify length
        self.out = torch.zeros(B, self.block + 1, dtype=torch.long, device=source.device)
        self.static: dict[int, _Bucket] = capture_buckets(source.buckets, self._bucket, self._forward, pool, capture_fn)
        keys = capture_buckets(source.buckets, lambda B: _KeysOnly(self.static[B]), self._keys_forward, pool, capture_fn)
        for B, k in keys.items():
            self.static[B].keys_only = k

    def _bucket(self, B: int) -> _Bucket:
        p, T = self.proposer, self.source.static[B].T
        fields, at = {}, 0
        for name, n in zip(_FIELDS, (T, B, B, B)):
            fields[name], at = (at, n), at + n
        pad = np.zeros(at, dtype=np.int64)  # starts and tokens 0
        for name, v in (("ring_rows", p.scratch * p.window), ("slots", p.scratch)):
            o, n = fields[name]
            pad[o:o + n] = v
        flat = torch.from_numpy(pad.copy()).to(self.source.device)
        return _Bucket(B, T, fields, flat, StagingPair(at, self.source.device.type == "cuda"), pad)

    def _write_keys(self, bk: _Bucket) -> None:
        p = self.proposer
        p.drafter.write_context(self.model, p.ring, self.source.features[:bk.T], self.source.static[bk.B].fb.positions,
                                bk.view("ring_rows"))

    def _keys_forward(self, k: _KeysOnly) -> None:
        self._write_keys(k.full)

    def _forward(self, bk: _Bucket) -> None:
        p = self.proposer
        self._write_keys(bk)
        d = p.drafter.draft_from_ring(self.model, p.ring, bk.view("slots"), bk.view("starts"), bk.view("last_tokens"),
                                      p.threshold)
        self.out[:bk.B, :self.block].copy_(d.tokens)
        self.out[:bk.B, self.block].copy_(gated_lengths(d, p.threshold))

    def launch(self, batch, items, where, drafting) -> Callable[[], list[list[int]]]:
        """items, where: engine/spec/decoder.py's _catch_up (each item's batch index and first row
        in the source step); drafting: the sequences that draft. Pack, one copy, replay the keys and
        blocks (or the keys only, when no sequence's window is ready to draft; on the CPU the static
        batch eagerly). -> read(): each drafting sequence's drafts (waits for the replay)."""
        bk = self.static[self.source.bucket(len(batch))]
        host = bk.stagings.next().numpy()
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
        if ready:
            replay_bucket(bk, self._forward)
        else:
            self.keys_replays += 1
            replay_bucket(bk.keys_only, self._keys_forward)

        def read() -> list[list[int]]:
            if not ready:
                return [[] for _ in drafting]
            out = self.out[:bk.B].tolist()
            return self.proposer.take(drafting, ready, [out[b][:self.block] for b in at],
                                      [out[b][self.block] for b in at])
        return read
