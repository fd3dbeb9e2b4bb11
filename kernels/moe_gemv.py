"""The MXFP4 MoE at decode's few rows on the CUDA cores (kernel variant moe_gemv): each routed (token, expert) pair a
GEMV, as kernels/fused_fp8_linear.py's GEMV runs an FP8 linear, in place of the MMA kernels of kernels/fused_moe.py.

Why: at one row the MMA kernels pad each expert's one row to a 16-row tile and move every decoded weight tile
through shared memory (or permute it into the MMA's registers: "bf16-frag"), and read the experts' bytes at ~30%
of DRAM bandwidth (80 us against ~24 us of bytes at V4-Flash's shape, 16 experts, on the H100: PERF.md). A GEMV
program streams its weight rows in 16-byte loads straight to registers, decodes them with integer ops
(kernels/fused_dequant.mxfp4_rows_parts_bf16: exact bf16 values, the group scale applied), multiplies each by
its activation in float32 and keeps a [BLOCK_N, BLOCK_K / 8] float32 accumulator, reduced across threads once at
the end. No tile padding, no shared memory, no alignment of the pairs by expert.

Grid (N tiles, pairs, K splits); a pair whose expert is -1 (another rank's) exits. Split-K partials are joined by
the last split of each (pair, N tile) to arrive (kernels/semaphores.py), which applies gate / up's clamped SwiGLU or
down's routing weight. Same arithmetic as kernels.reference.moe_experts up to summation order: bf16 h between the
two, float32 y, summed per token by kernels/fused_moe._sum_topk_kernel."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl, quant_configs
from kernels.activations import clamped_swiglu
from kernels.fused_dequant import mxfp4_rows_parts_bf16
from kernels.pdl import wait_and_release
from kernels.semaphores import semaphores, split_k_arrive, split_k_total

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ASM = tl.constexpr(not _INTERPRET)  # the decode's PTX; the interpreter runs the same bit operations in Triton

MOE_GEMV_MAX_ROWS = 4  # tokens a call up to which the variant takes it (decode's few rows)
TILES = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}
INTERPRET_TILES = {"BLOCK_N": 16, "BLOCK_K": 64}


@triton.jit
def _rows_dot(acc, w_ptr, s_ptr, a_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              ASM: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 8] += the expert rows n of one K step (stored e2m1 pairs [N, K / 2], ue8m0 bytes
    [N, K / 32]) times the activation row at a_ptr: decoded value q of each 32-bit word (K = k0 + 8 w + q) meets
    the activation at the same K."""
    W: tl.constexpr = BLOCK_K // 8
    o0, o1, o2, o3, o4, o5, o6, o7 = mxfp4_rows_parts_bf16(w_ptr, s_ptr, n, k0, N, K, BLOCK_N, BLOCK_K, ASM)
    kw = k0 + 8 * tl.arange(0, W)
    kmask = kw < K
    acc += o0.to(tl.float32) * tl.load(a_ptr + kw, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o1.to(tl.float32) * tl.load(a_ptr + kw + 1, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o2.to(tl.float32) * tl.load(a_ptr + kw + 2, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o3.to(tl.float32) * tl.load(a_ptr + kw + 3, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o4.to(tl.float32) * tl.load(a_ptr + kw + 4, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o5.to(tl.float32) * tl.load(a_ptr + kw + 5, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o6.to(tl.float32) * tl.load(a_ptr + kw + 6, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += o7.to(tl.float32) * tl.load(a_ptr + kw + 7, mask=kmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _program(idx_ptr, BLOCK_N: tl.constexpr):
    """(N tile, pair, K split, the pair's expert: -1 for another rank's, this program's N rows)."""
    pid_n, p, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    return pid_n, p, pid_k, tl.load(idx_ptr + p), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, ws_ptr, sem_ptr, idx_ptr, D, I, TOPK, limit,
                         K_SPLIT, n_pairs, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ASM: tl.constexpr, PDL: tl.constexpr = False):
    """h[p, n-tile] = SwiGLU(x[token] @ w1[e].T, x[token] @ w3[e].T) for pair p = (token, expert e)."""
    wait_and_release(PDL)  # the pair's expert comes from the router, the launch before
    pid_n, p, pid_k, e, n = _program(idx_ptr, BLOCK_N)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    w1, w3 = w1_ptr + e64 * I * (D // 2), w3_ptr + e64 * I * (D // 2)
    s1, s3 = s1_ptr + e64 * I * (D // 32), s3_ptr + e64 * I * (D // 32)
    a = x_ptr + (p // TOPK).to(tl.int64) * D
    acc1 = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, D), BLOCK_K):
        acc1 = _rows_dot(acc1, w1, s1, a, n, k0, I, D, BLOCK_N, BLOCK_K, ASM)
        acc3 = _rows_dot(acc3, w3, s3, a, n, k0, I, D, BLOCK_N, BLOCK_K, ASM)
    g, u = tl.sum(acc1, axis=1), tl.sum(acc3, axis=1)
    nmask = n < I
    last = True
    if SPLITS > 1:
        off = p * (2 * I) + n
        stride = n_pairs * 2 * I
        tl.store(ws_ptr + pid_k * stride + off + I, u, mask=nmask)  # up; the arrival stores gate and releases
        last = split_k_arrive(ws_ptr, off, nmask, g, sem_ptr + p * tl.num_programs(0) + pid_n, pid_k, stride, SPLITS)
        if last:
            g = split_k_total(ws_ptr, off, nmask, g, pid_k, stride, SPLITS)
            u = split_k_total(ws_ptr, off + I, nmask, u, pid_k, stride, SPLITS)
    if last:
        tl.store(h_ptr + p * I + n, clamped_swiglu(g, u, limit).to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_gemv_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, ws_ptr, sem_ptr, idx_ptr, D, I, K_SPLIT, n_pairs,
                      SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr = False):
    """y[p, n-tile] = routing weight of p * (h[p] @ w2[e].T), float32."""
    wait_and_release(PDL)
    pid_n, p, pid_k, e, n = _program(idx_ptr, BLOCK_N)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    w2, s2 = w2_ptr + e64 * D * (I // 2), s2_ptr + e64 * D * (I // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, I), BLOCK_K):
        acc = _rows_dot(acc, w2, s2, h_ptr + p.to(tl.int64) * I, n, k0, D, I, BLOCK_N, BLOCK_K, ASM)
    y = tl.sum(acc, axis=1)
    nmask = n < D
    off = p * D + n
    last = True
    if SPLITS > 1:
        last = split_k_arrive(ws_ptr, off, nmask, y, sem_ptr + p * tl.num_programs(0) + pid_n, pid_k, n_pairs * D,
                              SPLITS)
        if last:
            y = split_k_total(ws_ptr, off, nmask, y, pid_k, n_pairs * D, SPLITS)
    if last:
        tl.store(y_ptr + off, y * tl.load(rw_ptr + p).to(tl.float32), mask=nmask)


def takes(tokens: int, w1: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether moe_experts_fused runs a call as GEMVs: decode's few tokens, MXFP4 experts (int8 pairs with scales)
    whose K and N are whole 32-value groups (the decode's words and scale bytes)."""
    return (0 < tokens <= MOE_GEMV_MAX_ROWS and scale is not None and w1.dtype == torch.int8
            and w1.shape[2] % 16 == 0 and w1.shape[1] % 32 == 0)


def _splits(programs: int, k: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split): the MMA kernels' rule (quant_configs.moe_split_k: about MOE_WAVES programs an SM, each
    split at least two K steps), a step's few pairs giving a few hundred (pair, N tile) programs."""
    steps = triton.cdiv(k, block_k)
    s = quant_configs.moe_split_k({}, programs, steps)
    if _INTERPRET:
        s = min(max(s, 2), steps)  # the interpreter: the split-K join taken whenever two K steps allow it
    k_split = triton.cdiv(steps, s) * block_k
    return triton.cdiv(k, k_split), k_split


def moe_experts_gemv(x, w1, w3, w2, scales, weights, indices, limit, tiles: dict | None = None) -> torch.Tensor:
    """The routed experts' outputs y [pairs, D] (float32, each times its routing weight; rows of expert -1
    untouched) for x [T, D] and the pairs of indices / weights [T, k]: kernels/fused_moe's y, summed per token
    there. scales: the three ue8m0 byte tensors as stored."""
    cfg = dict(tiles) if tiles else TILES | (INTERPRET_TILES if _INTERPRET else {})  # a sweep's tiles as given
    T, D = x.shape
    E, I = w1.shape[:2]
    k = indices.shape[1]
    n_pairs = T * k
    s1, s3, s2 = (s.contiguous().view(torch.uint8) for s in scales)
    x = x if x.is_contiguous() else x.contiguous()
    idx = indices.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    h = torch.empty(n_pairs, I, dtype=x.dtype, device=x.device)
    y = torch.empty(n_pairs, D, dtype=torch.float32, device=x.device)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    for part, n_out, k_in in (("gate_up", I, D), ("down", D, I)):
        n_tiles = triton.cdiv(n_out, bn)
        splits, k_split = _splits(n_tiles * n_pairs, k_in, bk)
        width = 2 * I if part == "gate_up" else D
        ws = torch.empty(splits, n_pairs, width, dtype=torch.float32, device=x.device) if splits > 1 else y
        sem = semaphores(x.device, n_pairs * n_tiles) if splits > 1 else y
        grid = (n_tiles, n_pairs, splits)
        if part == "gate_up":
            _gate_up_gemv_kernel[grid](x, w1, w3, s1, s3, h, ws, sem, idx, D, I, k, limit, k_split, n_pairs,
                                       SPLITS=splits, BLOCK_N=bn, BLOCK_K=bk, ASM=_ASM, **opts, **pdl.options(x))
        else:
            _down_gemv_kernel[grid](h, w2, s2, y, rw, ws, sem, idx, D, I, k_split, n_pairs, SPLITS=splits,
                                    BLOCK_N=bn, BLOCK_K=bk, ASM=_ASM, **opts, **pdl.options(h))
    return y
