"""Where a DeepSeek-V4.1 checkpoint's bytes go before any is read: each rank's weights on its GPU,
the Engram tables on the GPU or in host memory, and what is left of the GPU for the KV cache.
Logged at start; a checkpoint that cannot fit the GPUs and host memory given is refused at once
(not after minutes of loading), with the numbers and what would make it fit.

Bytes come from the safetensors headers (nothing is read): each tensor's share on this rank
(engine/models/deepseek_v41/shards.py), as stored on CUDA (FP8 linears, MXFP4 experts kept; their
scales counted with them), in the model dtype where the CPU dequantizes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.deepseek_v41.config import V41Config
from engine.models.deepseek_v41.engram_tables import _header
from engine.models.deepseek_v41.names import official_name
from engine.models.deepseek_v41.shards import is_table, v41_shard_spec
from engine.models.weights import checkpoint_files
from engine.parallel import SKIP, TensorParallel

log = logging.getLogger(__name__)
_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1,
          "I32": 4, "I64": 8}
_QUANTIZED = ("F8_E4M3", "F8_E5M2", "I8")
_NOT_TEXT = ("vision.", "aligner.", "image_", "model.vision", "model.aligner", "model.image_", "mtp.")


class MemoryPlanError(ValueError):
    """The checkpoint cannot fit the GPUs and host memory given (the message says what would)."""


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # this rank's weights on its device, Engram tables there included
    engram_device: int  # of which the Engram tables (this rank's rows)
    engram_host: int  # this rank's Engram rows in host memory (mmap: pages the OS may drop)
    placement: str  # engram_tables: device | host | mmap
    device_total: int | None  # the GPU's memory (None: the CPU)
    host_available: int  # MemAvailable at start

    def lines(self, tp: TensorParallel) -> list[str]:
        rank = f"rank {tp.rank}/{tp.world}" if tp.world > 1 else "one rank"
        out = [f"weights on the device ({rank}): {self.weights / 1e9:.2f} GB"
               + (f", Engram tables {self.engram_device / 1e9:.2f} GB of it" if self.engram_device else "")]
        if self.placement != "device":
            out.append(f"Engram tables in host memory ({self.placement}): {self.engram_host / 1e9:.2f} GB per rank, "
                       f"{self.engram_host * tp.world / 1e9:.2f} GB for the host; {self.host_available / 1e9:.1f} GB available")
        if self.device_total is not None:
            out.append(f"left for the KV cache and activations: {(self.device_total - self.weights) / 1e9:.2f} GB of "
                       f"{self.device_total / 1e9:.2f} GB (the KV pools take gpu_memory_utilization of it)")
        return out

    def check(self, tp: TensorParallel) -> None:
        if self.device_total is not None and self.weights > 0.95 * self.device_total:
            hint = "a larger tensor_parallel_size" + (", engram_tables: host or mmap" if self.engram_device else "")
            raise MemoryPlanError(f"this checkpoint does not fit: each rank's weights take {self.weights / 1e9:.1f} GB "
                                  f"of a {self.device_total / 1e9:.1f} GB GPU at tensor_parallel_size={tp.world}; "
                                  f"use {hint}")
        if self.placement == "host" and self.engram_host * tp.world > self.host_available:
            raise MemoryPlanError(f"the Engram tables take {self.engram_host * tp.world / 1e9:.1f} GB of host memory "
                                  f"(engram_tables: host) but {self.host_available / 1e9:.1f} GB is available; use "
                                  "engram_tables: mmap (read from the checkpoint's pages, no copy in RAM)")


def host_available() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_memory(model_dir: str | Path, cfg: V41Config, tp: TensorParallel, placement: str, device: torch.device,
                dtype: torch.dtype, device_total: int | None = None, host_bytes: int | None = None) -> MemoryPlan:
    """device_total / host_bytes: the capacities to plan for (default: this GPU's, MemAvailable)."""
    if device_total is None and device.type == "cuda":
        device_total = torch.cuda.get_device_properties(device).total_memory
    entries = {}
    for path in checkpoint_files(model_dir):
        entries.update(_header(path)[1])
    weights = table_device = table_host = 0
    for name, entry in entries.items():
        if name == "__metadata__" or name.startswith(_NOT_TEXT):
            continue
        base = _weight_of(name, entries)  # a scale is cut as its weight
        official = official_name(base)
        numel = _share(official, entries[base], cfg, tp) * _numel(entry["shape"])
        stored = entry["dtype"]
        if stored in _QUANTIZED and device.type != "cuda":  # the CPU dequantizes (FP4: two values a byte)
            size = numel * (2 if stored == "I8" else 1) * dtype.itemsize
        elif stored in _QUANTIZED or base != name:
            size = numel * _BYTES[stored]
        else:
            size = numel * (4 if stored == "F32" else dtype.itemsize)
        table = official is not None and is_table(official)
        if table and placement != "device":
            table_host += numel * _BYTES[stored]  # kept as stored
            continue
        if table:  # on the device a table is dequantized to the model dtype, its scale folded in
            if base != name:
                continue
            size = numel * dtype.itemsize
        if base != name and device.type != "cuda":
            continue  # the CPU folds scales into the dequantized weight
        weights += size
        table_device += size if table else 0
    return MemoryPlan(int(weights), int(table_device), int(table_host), placement, device_total,
                      host_available() if host_bytes is None else host_bytes)


def _weight_of(name: str, entries: dict) -> str:
    for suffix in (".scale", ".weight_scale_inv", "_scale_inv"):
        if name.endswith(suffix):
            for cand in (name[: -len(suffix)] + ".weight", name[: -len(suffix)]):
                if cand in entries and cand != name:
                    return cand
    return name


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _share(official: str | None, weight: dict, cfg: V41Config, tp: TensorParallel) -> float:
    """The fraction of a tensor (and of its scale) this rank holds."""
    if tp.world == 1:
        return 1.0
    if official is None:  # transformers' fused experts: split over the ranks either way
        return 1.0 / tp.world
    spec = v41_shard_spec(official, cfg, tp)
    if spec is SKIP:
        return 0.0
    shape, frac = weight["shape"], 1.0
    for dim, lo, hi in spec:  # slices are in logical units: a packed FP4 byte holds two values
        frac *= (hi - lo) / (shape[dim] * (2 if weight["dtype"] == "I8" and dim == len(shape) - 1 else 1))
    return min(frac, 1.0)
