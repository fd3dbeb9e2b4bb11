"""Where a CUDA-graph step first parts from the same step run eagerly (tools.bench_mixed --diagnose).

Each step of a run goes three ways from one cache state: eagerly unpadded (build_batch), eagerly on
the padded batch the graph replays (a MixedStepGraphs built without capture; for a decode step the plain
eager step), then the graph itself; between them everything the step writes (the window and full
blocks holding its positions, the compressor states) is put back, and the run carries on from the
graph's result. Per step it prints the logits' differences and the first
(layer, cache write) where the graph's differs from the padded eager run's: the window KV a layer
writes depends on everything before that layer's attention, its compressed entries, indexer keys
and compressor state on its compressor, so the first differing write names the layer and the op.
The graph and the padded eager run execute the same kernels on the same tensors: a difference
beyond the split-K GEMV's summation order (about one bf16 ulp) is a capture / replay fault.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from engine.graphs.mixed import MixedStepGraphs
from engine.sequence import Sequence

_STATE_FIELDS = ("pend_kv", "pend_gate", "prev_kv", "prev_gate", "has_prev")


def _regions(cache, scheduled: list[tuple[Sequence, int]]) -> list[tuple[int, str, torch.Tensor, torch.Tensor | None]]:
    """(layer, what, tensor, rows or None for all of it) of everything the step writes, in the order a
    layer writes it: the window and full blocks that hold the step's positions, the compressor states."""
    bs = cache.block_size
    wb, fb = set(), set()
    for s, n in scheduled:
        lo, hi = s.num_computed_tokens, s.num_computed_tokens + n
        for b in range(lo // bs, (hi - 1) // bs + 1):
            wb.add(s.blocks.window_table[b])
            fb.add(s.blocks.full_table[b])
    dev = cache.window[0].device
    w = torch.tensor(sorted(wb), dtype=torch.long, device=dev)
    f = torch.tensor(sorted(fb), dtype=torch.long, device=dev)
    out = []
    for layer in range(cache.cfg.num_layers):
        out.append((layer, "window KV", cache.window[layer], w))
        for name, pool, st in (("compressor", cache.compressed[layer], cache.comp_state[layer]),
                               ("indexer", cache.index_keys[layer], cache.index_state[layer])):
            if st is None:
                continue
            out += [(layer, f"{name} state {fld}", getattr(st, fld), None) for fld in _STATE_FIELDS
                    if getattr(st, fld) is not None]
            out.append((layer, f"{name} entries", pool, f))
    return out


def cache_writes(cache, scheduled: list[tuple[Sequence, int]]) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, what, copy) of everything the step writes (see _regions)."""
    return [(layer, what, (t if rows is None else t[rows]).clone()) for layer, what, t, rows in _regions(cache, scheduled)]


def restore(cache, scheduled: list[tuple[Sequence, int]], saved: list[tuple[int, str, torch.Tensor]]) -> None:
    """Put cache_writes' copies back: the next run of the step starts from the same cache."""
    for (_, _, t, rows), (_, _, copy) in zip(_regions(cache, scheduled), saved):
        if rows is None:
            t.copy_(copy)
        else:
            t[rows] = copy


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (bool: the count of differing entries); inf where one side is NaN / inf and the other not."""
    if a.dtype == torch.bool:
        return float((a != b).sum())
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return 0.0
    d = (a - b).abs()[~same]
    return float(d.max()) if bool(torch.isfinite(d).all()) else float("inf")


def first_difference(got: list, want: list) -> dict | None:
    """The first (layer, write) where `got` differs from `want`, and the layers that differ at all."""
    first, layers = None, set()
    for (layer, what, a), (_, _, b) in zip(got, want):
        d = max_diff(a, b)
        if d:
            layers.add(layer)
            if first is None:
                scale = float(b.double().abs().max()) if b.dtype != torch.bool and b.numel() else 1.0
                first = {"layer": layer, "write": what, "max_abs_diff": d, "max_abs_value": scale}
    return None if first is None else {**first, "layers_differing": sorted(layers)}


class StepDiagnosis:
    """Installed as `runner.run` for one run: every decode-graph and mixed-graph step goes the three
    ways above; eager steps run as they are. `rows` collects one dict per step."""

    def __init__(self, runner, layer_types: list[str], label: str = "", unpadded: bool = True):
        """unpadded=False: a mixed step skips the unpadded eager run (its logits diff reads 0)."""
        self.runner, self.layer_types, self.label, self.unpadded = runner, layer_types, label, unpadded
        self.run_graphs = runner.run
        m = runner.mixed
        # the padded batches eagerly (on the CPU, where nothing is captured, both sides run eagerly)
        self.padded = MixedStepGraphs(runner.model, runner.cache, runner.max_model_len, m.max_num_seqs, m.sizes) if m else None
        self.rows: list[dict] = []

    def __call__(self, scheduled, all_logits=False, pending=None, prompt_rows=None):
        r = self.runner
        decode = r._decode_graph(scheduled, all_logits)  # the runner's own order: decode graphs first
        mixed = not decode and r.mixed is not None and r.mixed.fits(scheduled, all_logits)
        if prompt_rows is not None or not (decode or mixed):
            return self.run_graphs(scheduled, all_logits, pending, prompt_rows)
        pend = (pending[0], pending[1]) if pending is not None else None
        saved = cache_writes(r.cache, scheduled)
        unpadded = None
        if self.unpadded or not mixed:
            fb = r.build_batch(scheduled)
            r._fill_pending(fb.input_ids, scheduled, pend, [e - 1 for e in accumulate(n for _, n in scheduled)])
            unpadded = r.model(fb, r.cache).clone()
        if mixed:
            restore(r.cache, scheduled, saved)
            padded = self.padded.run(scheduled, pend, r._fill_pending).clone()
        else:
            padded = unpadded  # a decode step: the eager step is its padded-eager counterpart
        unpadded = padded if unpadded is None else unpadded
        want = cache_writes(r.cache, scheduled)
        restore(r.cache, scheduled, saved)
        logits = self.run_graphs(scheduled, all_logits, pending, prompt_rows)
        got = cache_writes(r.cache, scheduled)
        T = sum(n for _, n in scheduled)
        size = min(s for s in r.mixed.sizes if s >= T) if mixed else min(b for b in r.graphs if b >= len(scheduled))
        split = r.mixed.split if mixed else None  # V4.1 decoder trim: the tail graph over the kept rows
        row = {"step": len(self.rows), "path": "mixed" if mixed else "decode", "tokens": T, "graph_size": size,
               "tail_bucket": split.bucket(scheduled) if split is not None else None,
               "seqs": len(scheduled), "logits_graph_vs_padded_eager": max_diff(logits, padded),
               "logits_padded_vs_unpadded_eager": max_diff(padded, unpadded),
               "first_difference": first_difference(got, want)}
        self.rows.append(row)
        print(self.describe(row), flush=True)
        return logits

    def describe(self, row: dict) -> str:
        what = "padded eager" if row["path"] == "mixed" else "eager"
        s = (f"  diag{self.label} step {row['step']} ({row['path']}, {row['tokens']} tokens of {row['seqs']} seqs -> graph "
             f"{row['graph_size']}{'' if row['tail_bucket'] is None else ', tail ' + str(row['tail_bucket'])}): "
             f"logits |graph - {what}| {row['logits_graph_vs_padded_eager']:.2e}")
        if row["path"] == "mixed":
            s += f", |padded - unpadded eager| {row['logits_padded_vs_unpadded_eager']:.2e}"
        d = row["first_difference"]
        if d is None:
            return s + "; every cache write identical"
        layers = d["layers_differing"]
        return (s + f"; first differing write: layer {d['layer']} ({self.layer_types[d['layer']]}) {d['write']} "
                f"max |diff| {d['max_abs_diff']:.2e} of max |value| {d['max_abs_value']:.2e}; layers differing "
                f"{layers[0]}..{layers[-1]} ({len(layers)})")


def diagnose(eng, run, label: str = "", unpadded: bool = True) -> list[dict]:
    """`run()` (a generation on `eng`) with every graph step diagnosed; returns the rows."""
    diag = StepDiagnosis(eng.runner, [str(t) for t in eng.cfg.layer_types], label, unpadded)
    eng.runner.run = diag
    try:
        run()
    finally:
        del eng.runner.run  # back to the class's method
    return diag.rows
