"""MXFP4 expert weights unpacked to bf16: e2m1 pairs [E, N, K/2] (int8) with ue8m0 bytes [E, N, K/32] ->
[E, N, K]. One pass: each stored byte read once, each output element written once. The decode is the fused MoE's own
(kernels/fused_dequant.mxfp4_rows_tile_bf16); e2m1 times a power of two is exact in bf16, so the result
equals kernels.formats' dequantizer to bf16 exactly. Used by kernels/moe_grouped.py."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused_dequant import mxfp4_rows_tile_bf16

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ASM = tl.constexpr(not _INTERPRET)  # the interpreter runs no inline PTX


@dataclass(frozen=True)
class UnpackTiles:
    """One program's tile (rows x K columns), warps (None: Triton's default) and programs (None: one per tile; a
    count: that many programs striding over all tiles, which leaves the other SMs to kernels running beside it)."""

    block_n: int = 64
    block_k: int = 128
    warps: int | None = None
    programs: int | None = None


UNPACK_TILES = UnpackTiles()  # tools/bench_unpack.py sweeps the candidates (suite prefill_unpack)
# the unpack started ahead of the layer's attention (kernel variant unpack_ahead): few programs, so attention keeps
# most SMs; 32 is a guess until suite prefill_unpack times the program counts on the GPU
AHEAD_TILES = UnpackTiles(64, 128, programs=32)


@triton.jit
def _unpack_tile(w_ptr, s_ptr, out_ptr, e, n_tile, k_tile, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr):
    """Expert e's [BLOCK_N, BLOCK_K] tile (n_tile, k_tile) decoded and stored."""
    e = e.to(tl.int64)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = k_tile * BLOCK_K
    t = mxfp4_rows_tile_bf16(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), n, k0, N, K, BLOCK_N, BLOCK_K, ASM)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e * N * K + n[:, None] * K + k[None, :], t, mask=(n < N)[:, None] & (k < K)[None, :])


@triton.jit
def _mxfp4_unpack_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    _unpack_tile(w_ptr, s_ptr, out_ptr, tl.program_id(2), tl.program_id(0), tl.program_id(1), N, K, BLOCK_N, BLOCK_K,
                 ASM)


@triton.jit
def _mxfp4_unpack_strided_kernel(w_ptr, s_ptr, out_ptr, N, K, total, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ASM: tl.constexpr):
    """Each program takes every num_programs-th tile, K tiles fastest: neighbouring programs read neighbouring
    bytes."""
    k_tiles = K // BLOCK_K
    n_tiles = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        _unpack_tile(w_ptr, s_ptr, out_ptr, t // (n_tiles * k_tiles), (t // k_tiles) % n_tiles, t % k_tiles, N, K,
                     BLOCK_N, BLOCK_K, ASM)


def mxfp4_unpacked(weight: torch.Tensor, scale: torch.Tensor, tiles: UnpackTiles | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """weight int8 [E, N, K/2], scale ue8m0 [E, N, K/32] -> bf16 [E, N, K] (tiles: a launch to time instead of
    UNPACK_TILES; out: the bf16 [E, N, K] tensor to write, allocated by a caller that launches on another stream)."""
    tiles = tiles or UNPACK_TILES
    E, N, KH = weight.shape
    K = 2 * KH
    if K % tiles.block_k:
        raise ValueError(f"MXFP4 unpack: K {K} must be a multiple of {tiles.block_k}")
    weight = weight.contiguous()
    if weight.data_ptr() % 16:
        raise ValueError("MXFP4 expert weights must start 16-byte aligned")
    scale = scale.contiguous().view(torch.uint8)
    if out is None:
        out = torch.empty(E, N, K, dtype=torch.bfloat16, device=weight.device)
    elif out.shape != (E, N, K) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"MXFP4 unpack: out must be a contiguous bf16 {(E, N, K)}, got {out.dtype} {tuple(out.shape)}")
    if E and N:
        launch = {"num_warps": tiles.warps} if tiles.warps and not _INTERPRET else {}
        args = dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ASM=_ASM, **launch)
        n_tiles, k_tiles = triton.cdiv(N, tiles.block_n), K // tiles.block_k
        if tiles.programs is None:
            _mxfp4_unpack_kernel[(n_tiles, k_tiles, E)](weight, scale, out, N, K, **args)
        else:
            total = E * n_tiles * k_tiles
            _mxfp4_unpack_strided_kernel[(min(tiles.programs, total),)](weight, scale, out, N, K, total, **args)
    return out
