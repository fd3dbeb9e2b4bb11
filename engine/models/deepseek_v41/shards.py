"""What one tensor-parallel rank of DeepSeek-V4.1 reads (engine/parallel.py says how V4 is cut).

V4.1 is cut as V4: its heads (wq_b rows, sinks) and their share of the grouped output projection,
routed experts whole per rank (expert parallel) or every expert's intermediate slice, the shared
expert's intermediate slice; each joined by one all-reduce per sublayer. What V4.1 adds:
- replicated: the compressors, the indexers (their queries, keys and weights: a few MB a layer),
  the cross-layer KV sources and the two-level top-k. Every rank computes them from the same
  (all-reduced) residual, so its top-k, candidates and compressed cache equal rank 0's bit for bit
  and no collective sits on the CSA2 path; decoder trim keeps the same rows on every rank (it is
  decided from the host batch);
- split by rows: the Engram tables (most of the released checkpoint's bytes). Rank r holds rows
  [R * r / N, R * (r + 1) / N) of each table; a step's lookup gathers the rows it holds, zeros for
  the rest, and one all-reduce sums them: each row comes from exactly one rank, plus zeros, so the
  sum is that row exactly. Per-rank table memory is 1/N, host or device.
Reads take only the rank's slices from the safetensors file; a stored scale is cut with its
weight, and a cut that would split a scale block is refused naming the tensor.
"""

from __future__ import annotations

import re

import torch

from engine.models.deepseek_v41.config import V41Config
from engine.models.weights import WeightsError, _read
from engine.parallel import FULL, SKIP, TensorParallel, shard_spec

_TABLE = re.compile(r"^layers\.(\d+)\.engram\.embed\.weight$")


def is_table(name: str) -> bool:
    return _TABLE.match(name) is not None


def table_names(layer: int) -> tuple[str, ...]:
    """Layer `layer`'s Engram table as a checkpoint may store it: official, transformers'."""
    return f"layers.{layer}.engram.embed.weight", f"model.engram_tables.{layer}.weight"


def table_span(cfg: V41Config, layer: int, tp: TensorParallel) -> tuple[int, int]:
    """This rank's [lo, hi) rows of layer `layer`'s Engram table."""
    return tp.row_span(cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)])


def v41_shard_spec(name: str, cfg: V41Config, tp: TensorParallel):
    """engine/parallel.py's shard_spec plus the Engram tables' row split (official names)."""
    if tp.world == 1:
        return FULL
    table = _TABLE.match(name)
    if table:
        return ((0, *table_span(cfg, int(table.group(1)), tp)),)
    return shard_spec(name, cfg, tp)


def read_share(handle, name: str, spec: tuple, div: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """The slices `spec` of stored tensor `name` (logical units; stored = logical // div[dim]);
    refused when a slice edge falls inside a stored block (a packed FP4 byte, a scale tile)."""
    for dim, lo, hi in spec:
        if lo % div[dim] or hi % div[dim]:
            raise WeightsError(f"{name}: this rank's slice [{lo}, {hi}) of dim {dim} cuts a block of {div[dim]} "
                               "(tensor_parallel_size does not split this tensor on its scale blocks)")
    return _read(handle, name, spec, div)


def slice_loaded(t: torch.Tensor, spec) -> torch.Tensor | None:
    """A tensor read whole (transformers' fused experts) cut to `spec` in memory; None: SKIP."""
    if spec is SKIP:
        return None
    for dim, lo, hi in spec:
        t = t.narrow(dim, lo, hi - lo)
    return t
