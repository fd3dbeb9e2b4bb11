"""MXFP4 expert weights unpacked to bf16: e2m1 pairs [E, N, K/2] (int8) with ue8m0 bytes [E, N, K/32] ->
[E, N, K]. One pass: each stored byte read once, each output element written once. The decode is the fused MoE's own
(kernels/fused_dequant.mxfp4_rows_tile_bf16); e2m1 times a power of two is exact in bf16, so the result
equals kernels.formats' dequantizer to bf16 exactly. Used by kernels/moe_grouped.py."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.fused_dequant import mxfp4_rows_tile_bf16

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ASM = tl.constexpr(not _INTERPRET)  # the interpreter runs no inline PTX


@dataclass(frozen=True)
class UnpackTiles:
    """One program's tile (rows x K columns) and warps (None: Triton's default)."""

    block_n: int = 64
    block_k: int = 128
    warps: int | None = None


# tools/bench_unpack.py sweeps the candidates (suite prefill_unpack): at V4-Flash's 16 experts 16 x 512 with 4 warps
# the fastest (1.08x the copy floor against 1.13x for 64 x 128); every tile within 1.1-1.3x
UNPACK_TILES = UnpackTiles(16, 512, 4)


def table_tiles(K: int) -> UnpackTiles:
    """UNPACK_TILES with its K step halved until it divides K (V4.1's expert width 2304: 256)."""
    block_k = UNPACK_TILES.block_k
    while K % block_k and block_k > 32:
        block_k //= 2
    return replace(UNPACK_TILES, block_k=block_k)


@triton.jit
def _mxfp4_unpack_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    t = mxfp4_rows_tile_bf16(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), n, k0, N, K, BLOCK_N, BLOCK_K, ASM)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e * N * K + n[:, None] * K + k[None, :], t, mask=(n < N)[:, None] & (k < K)[None, :])


def mxfp4_unpacked(weight: torch.Tensor, scale: torch.Tensor, tiles: UnpackTiles | None = None) -> torch.Tensor:
    """weight int8 [E, N, K/2], scale ue8m0 [E, N, K/32] -> bf16 [E, N, K] (tiles: a launch to time instead of
    the table's, whose K step must divide K)."""
    E, N, KH = weight.shape
    K = 2 * KH
    tiles = tiles or table_tiles(K)
    if K % tiles.block_k:
        raise ValueError(f"MXFP4 unpack: K {K} must be a multiple of {tiles.block_k}")
    weight = weight.contiguous()
    if weight.data_ptr() % 16:
        raise ValueError("MXFP4 expert weights must start 16-byte aligned")
    scale = scale.contiguous().view(torch.uint8)
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=weight.device)
    if E and N:
        grid = (triton.cdiv(N, tiles.block_n), K // tiles.block_k, E)
        launch = {"num_warps": tiles.warps} if tiles.warps and not _INTERPRET else {}
        _mxfp4_unpack_kernel[grid](weight, scale, out, N, K, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ASM=_ASM,
                                   **launch)
    return out
