"""DeepSeek-V4.1's padded mixed step as two CUDA graphs, split at the last KV source (decoder trim).

The layers after the last KV source own only window KV, so decoder trim runs them on each
sequence's last `sliding_window` rows. One graph per token count T fixes how many rows those layers
run: at a serving max_num_seqs no count below T holds every step's kept rows, and such a graph
trims nothing. So a step runs as
- the front, MixedStepGraphs' graph of size T: embedding .. the last KV source over every row, leaving
  what the later layers read of each row (the hc streams h, the next site's pre, the last top-k,
  the candidate blocks) in this object's buffers, shared by every front;
- the tail, a graph per kept-row bucket K (the mixed sizes up to the largest): the kept rows as a
  padded batch of their own (positions, window slots, block tables, raised replay starts, Engram
  look-back: packed on the host, which knows the kept count and picks the smallest K that holds
  it), their state gathered from the buffers, the later layers, the final norm and the LM head
  into MixedStepGraphs' logits. Ropes are recomputed from the kept positions, Engram rows of layers
  after the split from the kept ids.
Padding rows of the tail take row 0's state and the padding sequence's scratch blocks; they select
no compressed entries. Decoder trim switched off after capture keeps every row: exact.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.graphs.capture import capture_buckets
from engine.graphs.mixed import mixed_sizes
from engine.graphs.static_batch import (
    StaticBatch,
    host_fields,
    new_token_ids,
    pack_rows,
    padded_batch,
    step_layout,
)
from engine.models.deepseek_v41.mixed_rows import V41MixedRows


@dataclass
class FrontState:
    """What the tail reads of the front, for every row of the largest size (fixed addresses)."""

    h: torch.Tensor  # [T, hc, D] the hc streams after the last KV source
    pre: torch.Tensor  # [T, hc] fp32: the next site collapses with it
    topk: torch.Tensor | None  # [T, index_topk] the last index source's picks (None: no index source yet)
    candidates: torch.Tensor | None  # [T, entries] bool: the candidate source's blocks (None: none yet)


class DecoderSplitGraphs:
    """The front's buffers, the tail's padded batches (and graphs) per bucket, their packing."""

    def __init__(self, model, cache, sizes: list[int], max_num_seqs: int, width: int, max_model_len: int):
        cfg = model.cfg
        self.model, self.cache = model, cache
        self.max_num_seqs, self.width, self.max_model_len = max_num_seqs, width, max_model_len
        self.cut = model.trim_cut
        self.window = cfg.sliding_window
        self.sizes = mixed_sizes(max(sizes)) if sizes else []  # kept-row buckets
        self.front_engram = tuple(i for i in cfg.engram_layer_ids if i < self.cut)  # Engram layers in the front
        self.engram = tuple(i for i in cfg.engram_layer_ids if i >= self.cut)  # and in the tail
        self.rows = V41MixedRows(model, cache, lookback=bool(self.engram))  # the tail batch's own fields
        T, dev, dtype = max(sizes, default=0), next(model.parameters()).device, model.embed.weight.dtype
        cand = cfg.candidate_source_layer_id
        entries = max_model_len // cfg.compress_ratios[cfg.kv_source_of(cand)] if 0 <= cand < self.cut else 0
        # zeros and no entries until a front writes them: a tail run before any front (a capture's
        # warm-up) reads valid indices
        self.state = FrontState(
            h=torch.zeros(T, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=dev),
            pre=torch.zeros(T, cfg.hc_mult, dtype=torch.float32, device=dev),
            topk=(torch.full((T, cfg.index_topk), -1, dtype=torch.long, device=dev)
                  if any(i < self.cut for i in cfg.index_source_layer_ids) else None),
            candidates=torch.zeros(T, entries, dtype=torch.bool, device=dev) if entries else None)
        self.static: dict[int, StaticBatch] = {}
        self.logits: torch.Tensor | None = None
        self.replays = 0
        self.steps: Counter = Counter()  # (front size, tail bucket) -> steps run

    def build(self, pool, capture_fn, logits: torch.Tensor | None) -> None:
        """The tail batches, captured into `pool` when given (writing into MixedStepGraphs' `logits`)."""
        self.logits = logits
        self.static = capture_buckets(self.sizes, self._batch,
                                      lambda st: logits[:st.layout.S - 1].copy_(self.tail(st)), pool, capture_fn)

    def num_graphs(self) -> int:
        return sum(st.graph is not None for st in self.static.values())

    def _batch(self, K: int) -> StaticBatch:
        lay = step_layout(K, self.max_num_seqs, self.width, [], lambda T, S: self.rows.fields(T, S) + [("keep", T)])
        return padded_batch(lay, self.cache, next(self.model.parameters()).device, self.max_model_len, self.rows)

    # --- the two halves of the step ---------------------------------------------------------------

    @torch.inference_mode()
    def front(self, fb) -> None:
        """Every row through the layers up to the last KV source; their state into the buffers."""
        m, s = self.model, self.state
        h, pre, rows = m.embed_rows(fb, self.cache, self.front_engram)
        h, pre = m.run_layers(h, pre, rows, fb, self.cache, 0, self.cut)
        T = h.shape[0]
        s.h[:T].copy_(h)
        s.pre[:T].copy_(pre)
        if s.topk is not None:
            s.topk[:T].copy_(rows.topk)
        if s.candidates is not None:
            s.candidates[:T].copy_(rows.candidates)

    @torch.inference_mode()
    def tail(self, st: StaticBatch) -> torch.Tensor:
        """The kept rows of bucket st through the later layers -> logits of its logits rows."""
        m, s, fb = self.model, self.state, st.fb
        keep = st.views["keep"]
        rows = m.rows_of(fb, s.h.dtype, self.engram)
        if s.topk is not None:  # a padding row took row 0's state: it selects nothing
            pad = fb.token_seq == fb.replay_start_t.shape[0] - 1
            rows.topk = s.topk[keep].masked_fill(pad[:, None], -1)
        if s.candidates is not None:
            rows.candidates = s.candidates[keep]
        h, pre = m.run_layers(s.h[keep], s.pre[keep], rows, fb, self.cache, self.cut, None, full_rows=False)
        return m.logits_of(h[fb.logits_rows], pre[fb.logits_rows])

    # --- the host side ----------------------------------------------------------------------------

    def kept(self, scheduled) -> np.ndarray:
        """Rows each sequence keeps on the tail's layers (every row with decoder trim off)."""
        n = np.fromiter((k for _, k in scheduled), dtype=np.int64, count=len(scheduled))
        return np.minimum(n, self.window) if self.model.decoder_trim else n

    def bucket(self, scheduled) -> int:
        """The smallest tail bucket that holds the step's kept rows."""
        need = int(self.kept(scheduled).sum())
        return min(s for s in self.sizes if s >= need)

    def pack(self, scheduled, K: int, host: np.ndarray) -> int:
        """Write the step's kept rows into `host` in bucket K's flat layout, padding elsewhere:
        the kept rows as a batch of their own (each sequence from its first kept position), `keep`
        the front's row of each; returns the number of logits rows."""
        st = self.static[K]
        lay, S = st.layout, len(scheduled)
        host[:] = st.pad
        col = host_fields(st, host)
        n = np.fromiter((k for _, k in scheduled), dtype=np.int64, count=S)
        kept = self.kept(scheduled)
        computed = np.fromiter((s.num_computed_tokens for s, _ in scheduled), dtype=np.int64, count=S)
        starts = computed + n - kept
        batch = [(s, int(k)) for (s, _), k in zip(scheduled, kept)]
        ids = [new_token_ids(s, int(a), k) for (s, k), a in zip(batch, starts)]
        _, _, _, _, row0 = pack_rows(batch, ids, col, col("tables").reshape(2, lay.S, lay.width),
                                     self.cache.block_size, starts)
        total = int(kept.sum())
        col("keep")[:total] = np.repeat(np.cumsum(n) - kept - row0, kept) + np.arange(total)
        # a sequence that drops rows reads no position below its first kept one (as the eager trim)
        replay, dropped = col("replay_start_t")[:S], kept < n
        replay[dropped] = np.maximum(replay[dropped], starts[dropped])
        samples = starts + kept == np.fromiter((s.num_tokens for s, _ in scheduled), dtype=np.int64, count=S)
        rows = (row0 + kept - 1)[samples]
        col("logits_rows")[:len(rows)] = rows
        self.rows.pack(col, batch, starts, row0)
        return len(rows)

    def run(self, scheduled, size: int, pending, fill_pending, front) -> torch.Tensor:
        """After MixedStepGraphs packed and copied the front's batch (of `size`): pack the tail's, copy it,
        run front() (its graph, or the padded front eagerly), then the tail (staging as MixedStepGraphs)."""
        K = self.bucket(scheduled)
        st = self.static[K]
        self.replays += 1
        self.steps[size, K] += 1
        staging = st.stagings.next()
        n_logits = self.pack(scheduled, K, staging.numpy())
        st.flat.copy_(staging, non_blocking=True)
        fill_pending(st.fb.input_ids, scheduled, pending, (np.cumsum(self.kept(scheduled)) - 1).tolist())
        front()
        if st.graph is None:
            return self.tail(st)[:n_logits]
        st.graph.replay()
        return self.logits[:n_logits]
