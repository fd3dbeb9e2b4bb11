"""Mixed prefill + decode steps (and pure prefill chunks) as full CUDA graphs over a fixed token count.

Every op of a step reads its ragged metadata per token from device tensors (positions, the token's
sequence, block tables, replay starts), so a step graphs whole once that metadata has fixed shapes;
the one host-shaped part, the compressors' plan (engine/compress_plan.py), is padded here to its
upper bound for the token count. Why full graphs and not vLLM's piecewise ones: docs/perf/HISTORY.md,
"Mixed steps under CUDA graphs".

A step of T tokens over S sequences runs the batch of the smallest size >= T: padding tokens belong
to a padding sequence whose block tables hold the cache's scratch blocks, padding plan entries read
row 0 and write only the scratch block / slot, padding logits rows repeat row 0. The batch's
tensors are views of one flat buffer, so a step is one pinned host-to-device copy and one replay.
On the CPU (no graphs) the same padded batches run eagerly: the tests compare them with the
unpadded path there. A model may add fields of its own (`model.mixed_rows(cache)`: DeepSeek-V4.1's
Engram look-back, engine/models/deepseek_v41/mixed_rows.py) and run a step as two graphs (V4.1's decoder trim: the
layers after the last KV source on each sequence's last window only, engine/models/deepseek_v41/split_graphs.py).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.cache import KVCache
from engine.compress_plan import plan_arrays
from engine.graphs.capture import capture
from engine.graphs.static_batch import (
    StaticBatch,
    host_fields,
    new_token_ids,
    pack_rows,
    padded_batch,
    step_layout,
)
from engine.sequence import Sequence

# token counts captured: a step pads to the smallest >= its tokens (the budget itself is one)
MIXED_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    return [s for s in MIXED_SIZES if s < max_num_batched_tokens] + [max_num_batched_tokens]


class MixedStepGraphs:
    """The padded batches of every size, captured as CUDA graphs when `pool` is given."""

    def __init__(self, model, cache: KVCache, max_model_len: int, max_num_seqs: int, sizes: list[int], pool=None,
                 capture_fn=capture):
        """capture_fn: how a size's step is captured (the CPU tests pass an emulation of a CUDA graph)."""
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.ratios = model.compressed_ratios  # a compressor plan per ratio
        self.extra = model.mixed_rows(cache)
        self.width = -(-max_model_len // cache.block_size) + 1
        self.max_num_seqs = max_num_seqs
        self.sizes = sorted(set(sizes))
        self.static: dict[int, StaticBatch] = {}
        self.replays = 0  # mixed steps run through a padded batch
        # a model may run a step as two graphs (V4.1 with decoder trim: every row up to the last KV
        # source, then only the kept rows, engine/models/deepseek_v41/split_graphs.py); None: one graph per size
        self.split = model.mixed_split(cache, self.sizes, max_num_seqs, self.width, max_model_len)
        # every graph writes its logits into one buffer, so no graph keeps an output of its own in the pool
        rows = min(max(self.sizes, default=0), max_num_seqs)
        self.logits = torch.empty(rows, model.cfg.vocab_size, device=self.device) if pool is not None else None
        for size in sorted(self.sizes, reverse=True):  # largest first: smaller graphs reuse its memory
            st = self._static(size)
            if pool is not None:
                out = self.logits[:st.layout.S - 1]
                run = ((lambda st=st: self.split.front(st.fb)) if self.split is not None
                       else (lambda st=st, out=out: out.copy_(self.model(st.fb, self.cache))))
                st.graph, st.logits = capture_fn(run, pool)
            self.static[size] = st
        if self.split is not None:  # its tail graphs, in the same pool
            self.split.build(pool, capture_fn, self.logits)
        if pool is not None and self.device.type == "cuda":
            torch.cuda.synchronize()

    def fits(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> bool:
        T = sum(n for _, n in scheduled)
        return bool(self.sizes and not all_logits and T <= self.sizes[-1] and len(scheduled) <= self.max_num_seqs)

    def num_graphs(self) -> int:
        """CUDA graphs captured (the split's tail graphs included)."""
        own = sum(st.graph is not None for st in self.static.values())
        return own + (self.split.num_graphs() if self.split is not None else 0)

    # --- the padded batch -----------------------------------------------------------------------

    def _static(self, size: int) -> StaticBatch:
        lay = step_layout(size, self.max_num_seqs, self.width, self.ratios, self.extra and self.extra.fields)
        return padded_batch(lay, self.cache, self.device, self.max_model_len, self.extra)

    def pack(self, scheduled: list[tuple[Sequence, int]], size: int, host: np.ndarray) -> int:
        """Write the step into `host` in `size`'s flat layout (what build_batch gives for the real
        rows, padding elsewhere); returns the number of logits rows."""
        c, st = self.cache, self.static[size]
        lay, bs = st.layout, c.block_size
        host[:] = st.pad
        col = host_fields(st, host)
        tables = col("tables").reshape(2, lay.S, lay.width)
        ids = [new_token_ids(s, s.num_computed_tokens, k) for s, k in scheduled]
        n, starts, cfrom, slots, row0 = pack_rows(scheduled, ids, col, tables, bs)
        S = len(scheduled)
        samples = starts + n == np.fromiter((s.num_tokens for s, _ in scheduled), dtype=np.int64, count=S)
        rows = (row0 + n - 1)[samples]
        col("logits_rows")[:len(rows)] = rows
        num_slots = c.scratch_slot + 1  # every state slot, the scratch one included
        for m, parts in lay.plans.items():
            arrays = plan_arrays(n, starts, cfrom, slots, m, bs, num_slots, lay.T)
            for (o, _), a in zip(parts, arrays):
                host[o:o + len(a)] = a
        if self.extra is not None:
            self.extra.pack(col, scheduled, starts, row0)
        return len(rows)

    def run(self, scheduled: list[tuple[Sequence, int]], pending, fill_pending) -> torch.Tensor:
        """Pack into a staging buffer, one copy, replay (or run the padded batch, on the CPU). A
        staging buffer is packed again two mixed steps later, by when the engine has read back
        (so waited for) the step that copied from it."""
        T = sum(n for _, n in scheduled)
        size = min(s for s in self.sizes if s >= T)
        st = self.static[size]
        self.replays += 1
        staging = st.stagings.next()
        n_logits = self.pack(scheduled, size, staging.numpy())
        st.flat.copy_(staging, non_blocking=True)
        ends = np.cumsum([n for _, n in scheduled]) - 1
        fill_pending(st.fb.input_ids, scheduled, pending, ends.tolist())
        if self.split is not None:  # this size's front graph, then the tail graph that holds the step's kept rows
            front = st.graph.replay if st.graph is not None else (lambda: self.split.front(st.fb))
            return self.split.run(scheduled, size, pending, fill_pending, front)[:n_logits]
        if st.graph is None:
            return self.model(st.fb, self.cache)[:n_logits]
        st.graph.replay()
        return st.logits[:n_logits]
