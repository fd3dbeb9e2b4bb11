"""Safetensors loading under DeepSeek's official tensor names.

Single file or sharded (`model.safetensors.index.json`); tensors stream one at a time
(never a full copy of the model in RAM); FP8 e4m3 weights with 128x128 block scales
(`<name>.scale` or `<name>_scale_inv`) are dequantised at load; MTP tensors are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

FP8_BLOCK = 128
_SKIP = re.compile(r"^(mtp\.|model\.mtp\.)|\.mtp\.")


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


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp8 e4m3 [out, in] times one fp32 scale per 128x128 block -> fp32."""
    out_f, in_f = weight.shape
    s = scale.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return weight.float() * s


def _scale_name(names: set[str], name: str) -> str | None:
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    for cand in (stem + ".scale", name + "_scale_inv", stem + ".weight_scale_inv"):
        if cand in names:
            return cand
    return None


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (official name, tensor) one at a time; FP8 dequantised to fp32, scales consumed.
    A scale may live in another shard than its weight."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in checkpoint_files(model_dir)]
        where = {name: h for h in handles for name in h.keys()}
        names = set(where)
        scales = {s for n in names if (s := _scale_name(names, n)) is not None and s != n}
        for name in sorted(names):
            if _SKIP.search(name) or name in scales:
                continue
            t = where[name].get_tensor(name)
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                scale_name = _scale_name(names, name)
                if scale_name is None:
                    raise WeightsError(f"FP8 tensor {name} has no .scale / _scale_inv beside it")
                t = dequantize_fp8(t, where[scale_name].get_tensor(scale_name))
            elif t.dtype in (torch.uint8, torch.int8) and "tid2eid" not in name:
                raise WeightsError(f"{name} is packed {t.dtype} (FP4 experts?): not supported")
            yield name, t
