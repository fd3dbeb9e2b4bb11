"""Mixed prefill + decode steps (and pure prefill chunks) as full CUDA graphs over a fixed token count.

Every op of a step reads its ragged metadata per token from device tensors (positions, the token's
sequence, block tables, replay starts), so a step graphs whole once that metadata has fixed shapes;
the one host-shaped part, the compressors' plan (engine/compress_plan.py), is padded here to its
upper bound for the token count. Why full graphs and not vLLM's piecewise ones: docs/PERF.md,
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

from dataclasses import dataclass

import numpy as np
import torch

from engine.cache import KVCache
from engine.compress_plan import CompressPlan, plan_arrays
from engine.forward_batch import ForwardBatch
from engine.sequence import Sequence

# token counts captured: a step pads to the smallest >= its tokens (the budget itself is one)
MIXED_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    return [s for s in MIXED_SIZES if s < max_num_batched_tokens] + [max_num_batched_tokens]


def capture(run, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Two warm-up runs on a side stream (Triton JIT, allocator), then one capture into `pool`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-ups' blocks stay cached for the side stream; the pool needs them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def new_token_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without concatenating the whole history."""
    p = seq.prompt_token_ids
    if start >= len(p):
        return seq.output_token_ids[start - len(p):start - len(p) + n]
    return p[start:start + n] + seq.output_token_ids[:max(0, start + n - len(p))]


def capture_buckets(buckets: list[int], make, forward, pool, capture_fn=capture) -> dict:
    """bucket -> make(bucket), whose `graph` captures forward(it) when `pool` is given (largest first:
    smaller graphs reuse its memory). capture_fn: the CPU tests pass an emulation of a CUDA graph."""
    out = {}
    for b in sorted(buckets, reverse=True):
        bk = make(b)
        if pool is not None:
            bk.graph, _ = capture_fn(lambda bk=bk: forward(bk), pool)
        out[b] = bk
    if pool is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def pack_rows(batch: list[tuple[Sequence, int]], token_ids: list[list[int]], col, tables: np.ndarray, bs: int,
              starts: np.ndarray | None = None):
    """The rows every padded static batch packs alike (mixed steps, speculative verify): each
    sequence's block tables over the padding fill, its `token_ids` at the positions after its
    computed tokens (or from `starts`), the window slots they write, its replay start and state
    slot (`col(name)`: that field of the flat host buffer). -> (rows per sequence, starts,
    compress_from, state slots, first row per sequence), numpy."""
    S = len(batch)
    n = np.fromiter((k for _, k in batch), dtype=np.int64, count=S)
    if starts is None:
        starts = np.fromiter((s.num_computed_tokens for s, _ in batch), dtype=np.int64, count=S)
    cfrom = np.fromiter((s.compress_from for s, _ in batch), dtype=np.int64, count=S)
    slots = np.fromiter((s.blocks.state_slot for s, _ in batch), dtype=np.int64, count=S)
    tables[0, :S], tables[1, :S] = -1, 0  # then each row's blocks over the fill
    for i, (s, _) in enumerate(batch):
        wt, ft = s.blocks.window_table, s.blocks.full_table
        tables[0, i, :len(wt)] = wt
        tables[1, i, :len(ft)] = ft
    ids = [t for row in token_ids for t in row]
    T = len(ids)
    row0 = np.cumsum(n) - n
    seq = np.repeat(np.arange(S), n)
    pos = np.arange(T) + np.repeat(starts - row0, n)
    col("input_ids")[:T] = ids
    col("positions")[:T] = pos
    col("token_seq")[:T] = seq
    col("window_slots")[:T] = tables[0, seq, pos // bs] * bs + pos % bs
    col("replay_start_t")[:S] = [s.replay_start for s, _ in batch]
    col("state_slot_t")[:S] = slots
    return n, starts, cfrom, slots, row0


@dataclass
class StepLayout:
    """Where each field sits in a size's flat buffer: (offset, length)."""

    T: int  # tokens
    S: int  # sequence rows: the real ones, then padding (row S - 1 at least is padding)
    width: int  # block-table columns
    fields: dict[str, tuple[int, int]]
    plans: dict[int, list[tuple[int, int]]]  # ratio -> its plan's parts
    caps: dict[int, int]  # ratio -> closed blocks the plan holds
    size: int


def step_layout(T: int, max_num_seqs: int, width: int, ratios: list[int], extra=None) -> StepLayout:
    """extra(T, S): the model's own fields, (name, length) (V4.1: engine/models/deepseek_v41/mixed_rows.py)."""
    S = min(T, max_num_seqs) + 1
    L = S - 1  # logits rows: one per sampling sequence at most
    fields, at = {}, 0
    for name, n in (("input_ids", T), ("positions", T), ("window_slots", T), ("token_seq", T),
                    ("replay_start_t", S), ("state_slot_t", S), ("logits_rows", L), ("tables", 2 * S * width),
                    *(extra(T, S) if extra else ())):
        fields[name] = (at, n)
        at += n
    plans, caps = {}, {}
    for m in ratios:
        # a closed block ends on a row of this step (so <= T) and at most one per sequence is not whole
        nb = min(T, T // m + L)
        caps[m] = nb
        plans[m] = []
        for n in (nb * m, nb, nb, nb, nb, nb, nb, L, L, T, T):
            plans[m].append((at, n))
            at += n
    return StepLayout(T, S, width, fields, plans, caps, at)


@dataclass
class StaticBatch:
    layout: StepLayout
    fb: ForwardBatch  # its tensors are views of `flat`; the graph reads them
    flat: torch.Tensor
    stagings: list[torch.Tensor]  # two host buffers, used by alternate steps (see MixedStepGraphs.run)
    pad: np.ndarray  # the all-padding contents of flat
    views: dict[str, torch.Tensor]  # every field of flat by name
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


def _pad_values(lay: StepLayout, cache: KVCache, extra) -> np.ndarray:
    c, bs = cache, cache.block_size
    host = np.zeros(lay.size, dtype=np.int64)
    f = lay.fields
    for name, v in (("window_slots", c.scratch_window * bs), ("token_seq", lay.S - 1),
                    ("state_slot_t", c.scratch_slot)):
        o, n = f[name]
        host[o:o + n] = v
    o, n = f["tables"]
    tables = host[o:o + n].reshape(2, lay.S, lay.width)
    tables[0], tables[1] = c.scratch_window, c.scratch_full
    for m, parts in lay.plans.items():
        # src, blk_seq, blk_entry, prev, bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst:
        # the padding sequence's (scratch) blocks, the scratch slot, row 0 to read
        vals = (0, lay.S - 1, 0, 0, 0, lay.S - 1, 0, c.scratch_slot, 0, 0, c.scratch_slot * m)
        for (o, n), v in zip(parts, vals):
            host[o:o + n] = v
    if extra is not None:
        extra.pad(lambda name: host[f[name][0]:f[name][0] + f[name][1]], lay.S)
    return host


def padded_batch(lay: StepLayout, cache: KVCache, device: torch.device, max_model_len: int, extra=None) -> StaticBatch:
    """The static batch of `lay`, all padding: its ForwardBatch's tensors are views of one flat
    device buffer. extra: the model's fields (`pad`, `attach`; V4.1: engine/models/deepseek_v41/mixed_rows.py)."""
    pad = _pad_values(lay, cache, extra)
    flat = torch.from_numpy(pad.copy()).to(device)
    v = {name: flat[o:o + n] for name, (o, n) in lay.fields.items()}
    tables = v["tables"].view(2, lay.S, lay.width)
    plans = {}
    for m, parts in lay.plans.items():
        plans[("compress", m)] = CompressPlan(m, lay.caps[m], *(flat[o:o + n] for o, n in parts))
    fb = ForwardBatch(
        input_ids=v["input_ids"], positions=v["positions"], seq_lens=[], starts=[], replay_starts=[],
        compress_from=[], window_slots=v["window_slots"], window_tables=tables[0], full_tables=tables[1],
        state_slots=[], logits_rows=v["logits_rows"], token_seq=v["token_seq"],
        replay_start_t=v["replay_start_t"], state_slot_t=v["state_slot_t"],
        is_decode=False, max_pos=max_model_len - 1,  # the indexer sizes for the longest sequence
        plans=plans)
    if extra is not None:
        extra.attach(fb, lambda name: v[name], lay.T)
    pin = device.type == "cuda"
    stagings = [torch.empty(lay.size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
    return StaticBatch(lay, fb, flat, stagings, pad, v)


def host_fields(st: StaticBatch, host: np.ndarray):
    """col(name): that field of `host` (a flat buffer in st's layout)."""
    f = st.layout.fields
    return lambda name: host[f[name][0]:f[name][0] + f[name][1]]


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
        staging = st.stagings[self.replays % 2]
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
