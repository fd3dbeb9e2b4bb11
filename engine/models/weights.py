"""Safetensors loading under DeepSeek's official tensor names.

Single file or sharded (`model.safetensors.index.json`); tensors stream shard by shard, one at a
time (never a full copy of the model in RAM), with progress in the log. Quantized weights
(kernels/formats.py: FP8 e4m3 with 128x128 block scales, MXFP4 experts with 1x32 ue8m0 scales)
come either dequantized to float32 (`dequantize=True`, the CPU path) or as stored, with their
scale beside them under `<stem>.scale` (FP8 block scales as float32 values, MXFP4 scales as their
ue8m0 bytes, the form the kernels read). Every scale is checked at load: present, the right
shape and dtype, finite. `mtp.*` tensors (the MTP layer) are yielded like the rest.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.formats import (
    FP8_BLOCK,
    MX_BLOCK,
    SCALE_DTYPES,
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp8_block_scale_shape,
    scale_to_float,
)

log = logging.getLogger(__name__)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PACKED_FP4 = torch.int8  # two e2m1 values per byte


class WeightsError(ValueError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors in {model_dir}")
    return files


def stem(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _scale_name(names: set[str], name: str) -> str | None:
    """`<stem>.scale` (DeepSeek), or V3-style `<name>_scale_inv` / `<stem>.weight_scale_inv`."""
    for cand in (stem(name) + ".scale", name + "_scale_inv", stem(name) + ".weight_scale_inv"):
        if cand in names:
            return cand
    return None


def check_scale(name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor) -> None:
    """Refuse a scale that cannot belong to `weight`, naming it."""
    if scale.dtype not in SCALE_DTYPES:
        raise WeightsError(f"{scale_name}: scale dtype {scale.dtype}, want float32 or float8_e8m0fnu (ue8m0)")
    n, k = weight.shape[-2:]
    if weight.dtype == PACKED_FP4:
        if (2 * k) % MX_BLOCK:
            raise WeightsError(f"{name}: packed FP4 width {k} is not a whole number of {MX_BLOCK}-value groups")
        want = (*weight.shape[:-2], n, 2 * k // MX_BLOCK)
    else:
        want = (*weight.shape[:-2], *fp8_block_scale_shape(n, k))
    if tuple(scale.shape) != want:
        raise WeightsError(f"{scale_name}: scale shape {tuple(scale.shape)} for weight {tuple(weight.shape)}, "
                           f"want {want}")
    values = scale_to_float(scale)
    if not torch.isfinite(values).all() or not (values > 0).all():
        raise WeightsError(f"{scale_name}: scale has NaN, inf or non-positive entries")


def _stored_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The form the kernels read: FP8 block scales as float32, MXFP4 scales as ue8m0 bytes."""
    if weight.dtype == PACKED_FP4:
        return scale_to_float(scale) if scale.dtype == torch.float32 else scale.view(torch.uint8)
    return scale_to_float(scale)


class _Progress:
    """One log line per shard: tensors, bytes, rate, ETA."""

    def __init__(self, files: list[Path], tensors: int):
        self.total_bytes = sum(p.stat().st_size for p in files)
        self.total_tensors, self.tensors, self.bytes = tensors, 0, 0
        self.files, self.start = len(files), time.perf_counter()

    def shard_done(self, i: int, path: Path, tensors: int) -> None:
        self.tensors += tensors
        self.bytes += path.stat().st_size
        dt = max(time.perf_counter() - self.start, 1e-9)
        rate = self.bytes / dt
        eta = (self.total_bytes - self.bytes) / rate if rate else 0.0
        log.info("weights: shard %d/%d %s: %d/%d tensors, %.2f/%.2f GB, %.2f GB/s, ETA %.0f s", i + 1, self.files,
                 path.name, self.tensors, self.total_tensors, self.bytes / 1e9, self.total_bytes / 1e9, rate / 1e9, eta)


def _read(handle, name: str, spec: tuple, div: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """The tensor, or only the slices `spec` ((dim, start, stop) in logical units; stored units =
    logical // div[dim]): safetensors reads just those bytes."""
    if not spec:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    idx = [slice(None)] * len(view.get_shape())
    for dim, lo, hi in spec:
        idx[dim] = slice(lo // div[dim], hi // div[dim])
    return view[tuple(idx)]


def iter_checkpoint(model_dir: str | Path, dequantize: bool = True,
                    shard: Callable[[str], tuple | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (official name, tensor) shard by shard. dequantize=True: FP8 / MXFP4 weights as float32,
    scales consumed; False: weights as stored, each followed by `<stem>.scale` (see module doc).
    A scale may live in another shard than its weight. `shard(name)`: what this rank reads
    (engine/parallel.py's shard_spec: None skips the tensor, else slices of it, scales cut to match)."""
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        where = {name: h for h in handles for name in h.keys()}
        names = set(where)
        owner = {s: n for n in names if (s := _scale_name(names, n)) is not None and s != n}
        orphans = sorted(n for n in names if n.endswith((".scale", "_scale_inv")) and n not in owner)
        if orphans:
            raise WeightsError(f"scale tensors without a weight: {orphans[:8]}")
        progress = _Progress(files, len(names) - len(owner))
        for i, (path, handle) in enumerate(zip(files, handles)):
            mine = sorted(n for n in handle.keys() if n not in owner)
            for name in mine:
                spec = shard(name) if shard is not None else ()
                if spec is None:
                    continue
                stored = handle.get_slice(name).get_dtype() if spec else ""
                packed = stored == "I8" and name.endswith(".weight")
                t = _read(handle, name, spec, (1, 2) if packed else (1, 1))
                quantized = t.dtype in FP8_DTYPES or (t.dtype == PACKED_FP4 and name.endswith(".weight"))
                if not quantized:
                    if t.dtype in (torch.uint8, torch.int8) and "tid2eid" not in name:
                        raise WeightsError(f"{name} is {t.dtype} but not a packed FP4 `.weight`: not supported")
                    yield name, t
                    continue
                scale_name = _scale_name(names, name)
                if scale_name is None:
                    kind = "FP8" if t.dtype in FP8_DTYPES else "packed FP4 (int8)"
                    raise WeightsError(f"{kind} tensor {name} has no .scale / _scale_inv beside it")
                scale = _read(where[scale_name], scale_name, spec,
                              (1, MX_BLOCK) if t.dtype == PACKED_FP4 else (FP8_BLOCK, FP8_BLOCK))
                check_scale(name, t, scale_name, scale)
                if dequantize:
                    yield name, dequantize_mxfp4(t, scale) if t.dtype == PACKED_FP4 else dequantize_fp8_block(t, scale)
                else:
                    yield name, t
                    yield stem(name) + ".scale", _stored_scale(t, scale)
            progress.shard_done(i, path, len(mine))


__all__ = ["FP8_BLOCK", "WeightsError", "check_scale", "checkpoint_files", "iter_checkpoint", "stem"]
