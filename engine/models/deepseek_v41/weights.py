"""DeepSeek-V4.1's stored formats: what the engine keeps as stored and what it dequantizes at load.

- FP8 e4m3 linears with one scale per `block` x `block` tile (32 in the released V4.1, 128 in V4),
  `<stem>.scale` (or transformers' `weight_scale_inv`) of shape [ceil(N/block), ceil(K/block)];
- packed FP4 e2m1 routed experts: int8 [N, K/2] (low nibble first) with one scale per g values
  along K, g = K / scale.shape[-1] (16 or 32);
- Engram tables: FP8 rows with one scale per row chunk ([rows, head_dim / c]).
Scales are ue8m0 (or float32). Kept as stored (loader_v41: on CUDA by default, on any device when
asked): the FP8 linears the forward runs through kernels.linear / grouped_linear (attention wq_a,
wq_b, wkv, wo_a, wo_b; the shared expert's w1, w3, w2; Engram's wkv), weight + float32 tile scales
(the FP8 kernels and kernels.reference read the block from the scale's shape), and routed experts in
MXFP4 exactly (g = 32, ue8m0) for the fused MoE. Dequantized to the model dtype: Engram tables (an
embedding gather, no FP8 path), FP4 experts in other groupings, FP8 DSpark (`mtp.*`) tensors, and
any FP8 tensor the model holds in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.deepseek_v41.names import official_name
from engine.models.deepseek_v41.shards import read_share
from engine.models.weights import WeightsError, checkpoint_files
from engine.parallel import FULL, SKIP
from kernels.formats import (
    E4M3_MAX,
    dequantize_fp8_block,
    fp8_block_scale_shape,
    scale_to_float,
    ue8m0_ceil,
    unpack_e2m1,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _scale_of(names: set[str], name: str) -> str | None:
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    for cand in (stem + ".scale", name + "_scale_inv", stem + ".weight_scale_inv"):
        if cand in names:
            return cand
    return None


def check_fp8_tiles(w: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """Refuse scales that do not tile e4m3 [N, K] in the config's block x block tiles."""
    if tuple(scale.shape[-2:]) != fp8_block_scale_shape(*w.shape[-2:], block):
        raise WeightsError(f"FP8 scale {tuple(scale.shape)} does not tile weight {tuple(w.shape)} in {block}x{block} "
                           "blocks (quantization_config.weight_block_size)")


def dequantize_fp4_groups(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] e2m1 pairs (low nibble = even k) x scales [N, K/g] -> float32 [N, 2K]."""
    vals = unpack_e2m1(w)
    k = vals.shape[-1]
    if k % scale.shape[-1] or scale.shape[:-1] != w.shape[:-1]:
        raise WeightsError(f"FP4 scale {tuple(scale.shape)} does not group weight {tuple(w.shape)}")
    return vals * scale_to_float(scale).repeat_interleave(k // scale.shape[-1], -1)


def dequantize_rows(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 table rows [R, D] x per-chunk scales [R, D / c] -> float32."""
    d = w.shape[-1]
    if scale.shape[0] != w.shape[0] or d % scale.shape[-1]:
        raise WeightsError(f"engram table scale {tuple(scale.shape)} does not fit rows {tuple(w.shape)}")
    return (w.float().unflatten(-1, (scale.shape[-1], -1)) * scale_to_float(scale).unsqueeze(-1)).flatten(-2)


_EXPERT_WEIGHT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_UE8M0 = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))


def _mxfp4_pair(name: str, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """A routed expert (official name) in MXFP4 exactly: e2m1 pairs with one ue8m0 byte per 32 values."""
    return (_EXPERT_WEIGHT.search(name) is not None and w.dtype == torch.int8 and scale.dtype in _UE8M0
            and scale.shape[:-1] == w.shape[:-1] and 2 * w.shape[-1] == 32 * scale.shape[-1])


def mxfp4_experts(model_dir: str | Path) -> bool:
    """Whether the checkpoint's routed experts are MXFP4 under official names (read from the first
    expert tensor's header: no data), so the fused MoE can read them as stored."""
    for p in checkpoint_files(model_dir):
        with safe_open(str(p), framework="pt") as f:
            for name in f.keys():
                if _EXPERT_WEIGHT.search(name):
                    scale = name[: -len(".weight")] + ".scale"
                    if scale not in f.keys():
                        return False
                    return _mxfp4_pair(name, f.get_slice(name)[:1], f.get_slice(scale)[:1])
    return False


def iter_v41_checkpoint(model_dir: str | Path, block: tuple[int, int] = (32, 32),
                        device: str | torch.device = "cpu", keep_mxfp4: bool = False,
                        keep_fp8: Callable[[str], bool] | None = None,
                        shard: Callable[[str], tuple | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as stored, float tensor on `device`) for every weight; scales are consumed. Stored
    weights move to `device` first and dequantize there (seconds on a GPU, not minutes).
    keep_mxfp4: routed MXFP4 experts come as stored instead, each with its ue8m0 scale bytes
    (`<stem>.scale`, uint8), for the fused MoE. keep_fp8(name): FP8 tiled linears it says yes to
    come as stored (e4m3), each followed by `<stem>.scale` in float32. shard(official name): what a
    tensor-parallel rank reads (engine/models/deepseek_v41/shards.py: None skips, else slices; the
    scale cut with its weight); a name with no one-tensor official name (transformers' fused
    experts) is read whole and cut by the loader."""
    files = [p for p in checkpoint_files(model_dir) if p.name.startswith("model")] or checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        where = {n: h for h in handles for n in h.keys()}
        names = set(where)
        owner = {s: n for n in names if (s := _scale_of(names, n)) is not None and s != n}
        for name in sorted(n for n in names if n not in owner):
            official = official_name(name)
            spec = shard(official) if shard is not None and official is not None else FULL
            if spec is SKIP:
                continue
            view = where[name].get_slice(name)
            packed = view.get_dtype() == "I8" and name.endswith(".weight")
            t = read_share(where[name], name, spec, (1, 2) if packed else (1, 1)).to(device)
            table = "engram_tables" in name or "engram.embed" in name
            quantized = t.dtype in FP8_DTYPES or (t.dtype == torch.int8 and name.endswith(".weight"))
            if not quantized:
                if t.dtype in (torch.int8, torch.uint8):
                    raise WeightsError(f"{name} is {t.dtype} but not a packed FP4 `.weight`: not supported")
                yield name, t
                continue
            scale_name = _scale_of(names, name)
            if scale_name is None:
                raise WeightsError(f"quantized tensor {name} has no .scale / weight_scale_inv beside it")
            scale = read_share(where[scale_name], scale_name, spec,
                               _scale_div(view.get_shape(), where[scale_name].get_slice(scale_name).get_shape(),
                                          packed, table, block[0])).to(device)
            if keep_mxfp4 and _mxfp4_pair(name, t, scale):
                yield name, t
                yield name[: -len(".weight")] + ".scale", scale.view(torch.uint8)
            elif t.dtype == torch.int8:
                yield name, dequantize_fp4_groups(t, scale)
            elif table:
                yield name, dequantize_rows(t, scale)
            else:
                check_fp8_tiles(t, scale, block[0])
                if keep_fp8 is not None and t.dtype == torch.float8_e4m3fn and name.endswith(".weight") and keep_fp8(name):
                    yield name, t
                    yield name[: -len(".weight")] + ".scale", scale_to_float(scale)
                else:
                    yield name, dequantize_fp8_block(t, scale)


def _scale_div(shape: list[int], scale_shape: list[int], packed: bool, table: bool, block: int) -> tuple[int, int]:
    """Logical weight units per stored scale entry along (dim 0, dim 1): a slice's scale is the
    slice's edges divided by these (read_share refuses edges inside one)."""
    if packed:  # [N, K/2] e2m1 pairs, one scale per g values along K
        return 1, 2 * shape[-1] // scale_shape[-1]
    if table:  # one scale per row chunk
        return 1, shape[-1] // scale_shape[-1]
    return block, block


def quantize_rows(w: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows [R, D] -> (e4m3 rows, ue8m0 scales [R, D / chunk])."""
    g = w.float().unflatten(-1, (-1, chunk))
    scale = ue8m0_ceil(g.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX)
    return (g / scale_to_float(scale).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).flatten(-2).to(torch.float8_e4m3fn), scale
