"""A DSpark step that verifies nothing, as a plain decode step's CUDA graph that also leaves the
target features.

When no sequence of a decode batch holds drafts (the acceptance gate backed them off, the confidence
head chose none; engine/spec/verify_gate.py), the step is a plain decode step: one row per sequence
on the decode path (not the verify graph's k + 1 rows per sequence, nor its rollback). DSpark's
drafter still needs that row's target features, to keep its key ring current, so each decode bucket
gets a second graph on the runner's own static decode batch (engine/runner.py: the same packed
rows, the same pinned copy), whose forward is the decode graph's plus the features written to a
static buffer. DSpark's drafter graph after it (engine/spec/dspark_graphs.py) reads them there as it
reads the verify graphs'. On the CPU (no pool) the same forward runs eagerly on the static batch.
Such a step may stay in flight (async scheduling, engine/spec/decoder.py): its tokens are read by
the next one on the device (`pending`), and alternate steps pack alternate staging buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.graphs.capture import capture, capture_buckets, replay_bucket
from engine.graphs.staging import StagingPair
from engine.sequence import Sequence


@dataclass
class _Bucket:
    B: int
    T: int  # rows: one per sequence
    fb: ForwardBatch  # the runner's static decode batch (views of flat)
    flat: torch.Tensor  # the runner's, refreshed by one copy per replay
    stagings: StagingPair  # the runner's pair for this batch: alternate with its decode graph's replays
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def staging(self) -> torch.Tensor:
        return self.stagings.current


class PlainStepGraphs:
    def __init__(self, runner, verify_buckets: list[int], pool=None, capture_fn=capture):
        """verify_buckets: the buckets DSpark's drafter graphs have (each needs the runner's static
        decode batch: its decode graphs, or static_decode_batches on the CPU). Built before any step
        runs, while those batches hold only padding (the capture's warm-up runs them)."""
        self.runner, self.model, self.cache = runner, runner.model, runner.cache
        self.device = runner.device
        self.buckets = sorted(b for b in set(verify_buckets) if b in runner.graphs)
        self.replays = 0
        cfg, B = self.model.cfg, max(self.buckets, default=0)
        self.logits = torch.zeros(B, cfg.vocab_size, device=self.device)
        self.features = torch.zeros(B, len(cfg.dspark.target_layer_ids) * cfg.hidden_size,
                                    dtype=self.model.embed.weight.dtype, device=self.device)
        self.static: dict[int, _Bucket] = capture_buckets(self.buckets, self._bucket, self._forward, pool, capture_fn)

    def _bucket(self, B: int) -> _Bucket:
        g = self.runner.graphs[B]
        return _Bucket(B, B, g.batch, g.flat, g.stagings)

    def _forward(self, bk: _Bucket) -> None:
        h, f = self.model.dspark_features(bk.fb, self.cache)
        self.features[:bk.B].copy_(f)
        self.logits[:bk.B].copy_(self.model.compute_logits(h))

    def bucket(self, batch_size: int) -> int:
        return min(b for b in self.buckets if b >= batch_size)

    def fits(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A decode step the runner would replay as a graph (its static batch is this one's) holding no
        drafts, within the largest bucket. A last token still in flight comes from `pending`."""
        return (bool(self.buckets) and len(batch) <= self.buckets[-1] and self.runner._decode_graph(batch)
                and not any(s.spec_token_ids for s, _ in batch))

    def run(self, batch: list[tuple[Sequence, int]],
            pending: tuple[torch.Tensor, dict[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack (the runner's decode layout), one copy, the in-flight step's tokens into the rows
        whose last token is pending (ModelRunner.run's `pending`), replay. -> (logits, target
        features), one row per sequence in batch order."""
        bk = self.static[self.bucket(len(batch))]
        self.replays += 1
        host: np.ndarray = bk.stagings.next().numpy()
        self.runner.pack_decode(batch, bk.B, host)
        replay_bucket(bk, self._forward,
                      lambda: self.runner._fill_pending(bk.fb.input_ids, batch, pending, list(range(len(batch)))))
        n = len(batch)
        return self.logits[:n], self.features[:n]
