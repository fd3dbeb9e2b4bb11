"""Block-scaled FP8 linear y = x @ dequant(W)^T, W e4m3 [N, K] with float32 B x B block scales (B = 128
in V4, 32 in V4.1: read from the scale's shape, a constexpr of every kernel; scale index n // B, k // B).

Five variants (the same result up to the activation rounding of "mma" and "cublas"):
- "dequant" (decode): a weight GEMV. Each program streams a [BLOCK_N, BLOCK_K] weight tile per
  step (row-major, so coalesced 16-byte loads), converts it to bf16 in registers (W_CVT:
  kernels/quant_configs.py) and multiplies it as the MMA's left operand against x^T (swap-AB:
  the few rows are the MMA's narrow side).
  The block scale is one value per weight row per step where BLOCK_K divides B (V4), applied to
  the partial product; with smaller blocks (V4.1's 32 under a 128-wide step) a step runs as
  BLOCK_K / B sub-steps, each rescaled by its own scale (V4's loop is the first branch, unchanged),
  or, config SCALE_TILE, as one MMA over the tile scaled per element in float32 first. Split-K (fp32 partials, then one reduce) gives narrow weights enough
  programs that every SM streams bytes.
- "gemv" (one or a few rows): the same on the CUDA cores, one activation row per program, no
  MMA and no shared memory (the weight read once per row: L2 serves the repeats of a few rows).
- "mma" (prefill): activations quantized once per 1x128 block by a small kernel (scale: the power
  of two >= absmax / 448, DeepSeek's ue8m0 act_quant), then the FP8 tensor cores multiply 128-wide
  K blocks, each rescaled by its activation and weight scales (DeepSeek's fp8_gemm scheme; with
  BLOCK_N dividing B the weight scale is one per tile, so the rescale is one FMA per element; B = 32:
  each 128-wide block as four 32-wide sub-dots, each rescaled by its own weight scales).
  Power-of-two scales make the division exact, so the kernel rounds each activation exactly as
  kernels.reference.linear_act_quant does.
- "unpacked" (prefill with V4.1's 32x32 blocks): the weight unpacked to x's dtype by one kernel
  (kernels/fp8_unpack.py), then torch's GEMM: kernels.reference.linear's arithmetic. It replaces
  "mma" for weights whose blocks are narrower than MMA_MIN_BLOCK.
- "cublas" (prefill with V4's 128x128 blocks, on Hopper): the activations quantized as "mma" does, then cuBLAS's
  blockwise FP8 GEMM (torch's scaled_mm); it replaces the tables' pick from quant_configs.FP8_CUBLAS_MIN_ROWS rows.
Which variant and tiles per shape: kernels/quant_configs.py (measured by tools/bench_quant.py).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import pdl, quant_configs, variants
from kernels.activations import clamped_swiglu
from kernels.formats import FP8_BLOCK, fp8_block_of
from kernels.fp8_unpack import fp8_unpacked
from kernels.pdl import wait_and_release
from kernels.semaphores import semaphores, split_k_arrive, split_k_total

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
# The tensor-core kernel runs a weight with smaller scale blocks (V4.1's 32) as 32-wide sub-dots, far
# slower than unpacking the weight and torch's GEMM (tools/bench_fp8_vs_bf16.py: 7.2-12.1x cuBLAS's time per
# V4.1 linear at 2048 rows, docs/PERF.md's DeepSeek-V4.1 section): where the tables pick
# "mma" for such a weight, "unpacked" runs instead
MMA_MIN_BLOCK = 128
# cuBLAS's own blockwise FP8 GEMM (torch's scaled_mm, DeepSeek's 1x128 x 128x128 recipe) for a 128x128-block
# weight at FP8_CUBLAS_MIN_ROWS rows or more (quant_configs), in place of the tables' "mma" or "dequant": faster
# for every V4 linear from 256 rows on the H200 (tools/bench_fp8_vs_bf16.py --only v4,
# docs/perf/h200-2026-12-03-s10/fp8_cublas.json). On Hopper only (quant_configs.hopper),
# not in the interpreter (CPU tests).
CUBLAS_OK = not _INTERPRET and hasattr(torch.nn.functional, "scaled_mm") and torch.cuda.is_available()
# cuBLAS takes whole groups of 4 K blocks in the scales: K a multiple of 512 (every V4 linear at tensor_parallel_size
# 1 is; a shard such as shared_w2's 256 columns at 8-way keeps the Triton kernels)
CUBLAS_K_ALIGN = 4 * FP8_BLOCK


VARIANTS = ("dequant", "gemv", "mma", "unpacked", "cublas")


def variant_for(m: int, n: int, k: int) -> str:
    if not _INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        return "dequant"  # no FP8 tensor cores before Ada / Hopper
    return quant_configs.fp8_linear_config(m, n, k)["variant"]


@triton.jit
def _round_e4m3(v):
    """e4m3 rounding (to nearest, ties to even, as torch and the hardware cast) in float32
    arithmetic. Only the interpreter uses it: its float32 -> e4m3 cast is wrong above 64 (seen:
    -124.7 -> -64). Ties happen: bf16 activations are short binary fractions."""
    a = tl.abs(v)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 0.015625))) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
    t = a / step
    f = tl.floor(t)
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = tl.minimum((f + ((t - f > 0.5) | ((t - f == 0.5) & odd)).to(tl.float32)) * step, 448.0)
    return tl.where(v < 0, -r, r)


# e4m3 -> bf16 with integer ops and one bf16x2 multiply per pair, no conversion-unit instructions
# (the plain cast is e4m3 -> f16 -> bf16: 1.5 conversions per weight byte). prmt spreads two bytes
# into the halves of a word with each byte's sign replicated above it; shifted by 4 and masked, a
# half is sign << 15 | (exponent, mantissa) << 4: the e4m3 value times 2^-120 as a bf16 (subnormals
# too: e4m3's land on bf16's); times 2^120 (0x7B80), exact. The -0.0 addend keeps -0.
_E4M3_BF16_ASM = tl.constexpr("""
{
.reg .b32 a, w, big, z;
mov.b32 big, 0x7B807B80;
mov.b32 z, 0x80008000;
cvt.u32.u16 w, $1;
prmt.b32 a, w, 0, 0x9180;
shl.b32 a, a, 4;
and.b32 a, a, 0x87F087F0;
fma.rn.bf16x2 $0, a, big, z;
}
""")


@triton.jit
def _out_offsets(m, n, M, N, N1):
    """Where y[m, n] goes when y is two row-major outputs back to back: [M, N1], then [M, N - N1]
    (two linears of one input in one launch, each output contiguous for its consumer; N1 = N: one)."""
    return tl.where(n < N1, m * N1 + n, M * N1 + m * (N - N1) + (n - N1))


@triton.jit
def _scaled_dot(w, xt, sw, DOT_F32: tl.constexpr, W_CVT: tl.constexpr):
    """W tile [BLOCK_N, k] (e4m3) @ x^T [k, BLOCK_M] times the weight rows' scales sw [BLOCK_N]: the k
    columns share one scale per row."""
    if DOT_F32:  # float32 activations (and the interpreter): the dequantized tile, exact float32 products
        return tl.dot(w.to(tl.float32) * sw[:, None], xt.to(tl.float32), input_precision="ieee")
    else:
        if W_CVT == "int":  # bf16 activations: integer ops (above), no conversion-unit instructions
            wb = tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,h", [w.to(tl.uint8, bitcast=True)],
                                           dtype=tl.bfloat16, is_pure=True, pack=2)
        elif W_CVT == "f32":  # e4m3 -> f16 -> f32 (FMA pipe) -> bf16 pack: no F2F.BF16.F16
            wb = w.to(tl.float32).to(xt.dtype)
        else:  # "cast": e4m3 -> f16 (F2FP) -> bf16 (F2F, one per byte)
            wb = w.to(xt.dtype)
        return tl.dot(wb, xt) * sw[:, None]


@triton.jit
def _x_tile(x_ptr, u_ptr, offs, mask, limit, ACT: tl.constexpr, nw_ptr=None, k=None, rstd=None,
            NORM: tl.constexpr = False):
    """The activations at offs; ACT: the clamped SwiGLU of (gate x, up u) computed here in float32 and rounded
    once to x's dtype, as the separate SwiGLU kernel (kernels.deepseek_v41.fused._pair_kernel) stores it.
    NORM: x's RMSNorm (rstd: its rows' 1 / rms, broadcast to offs; nw_ptr: the float32 weight at columns k),
    x * rstd * weight in float32 rounded once to x's dtype, as the RMSNorm kernel stores it."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ACT:
        x = clamped_swiglu(x.to(tl.float32), tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                           limit).to(x.dtype)
    if NORM:
        x = (x.to(tl.float32) * rstd * tl.load(nw_ptr + k, mask=mask, other=0.0)).to(x.dtype)
    return x


@triton.jit
def _rows_rstd(x_ptr, rows, rmask, X_STRIDE, K, eps, NORM: tl.constexpr, CH: tl.constexpr = 128):
    """1 / rms of the activation rows `rows` over all K columns (every split reads the whole row: K is the
    q LoRA rank, a few KB from L2), for the RMSNorm prologue; ones without NORM."""
    r = tl.full(rows.shape, 1.0, tl.float32)
    if NORM:
        ss = tl.zeros(rows.shape, tl.float32)
        for k0 in range(0, K, CH):
            c = k0 + tl.arange(0, CH)
            v = tl.load(x_ptr + rows[:, None] * X_STRIDE + c[None, :], mask=rmask[:, None] & (c < K)[None, :],
                        other=0.0).to(tl.float32)
            ss += tl.sum(v * v, axis=1)
        r = tl.rsqrt(ss / K + eps)
    return r


@triton.jit(do_not_specialize=["M"])
def _dequant_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, sem_ptr, M, N, N1, K, X_STRIDE, ROWS, K_SPLIT, u_ptr,
                    act_limit, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_F32: tl.constexpr, W_CVT: tl.constexpr = "cast", B: tl.constexpr = 128,
                    SCALE_TILE: tl.constexpr = False, ACT: tl.constexpr = False, nw_ptr=None, norm_eps=0.0,
                    NORM: tl.constexpr = False, PDL: tl.constexpr = False):
    """acc[BLOCK_N, BLOCK_M] = W[n, k-range] @ x[m, g * K + k-range]^T, g = the group of rows n (ROWS
    weight rows per group: wo_a's 8 groups read their own slice of x; a plain linear is one group).
    B: the scale block (128 V4, 32 V4.1). Split-K: each split stores its float32 partial, and the last
    split of a tile to finish (a counter per tile, reset by it for the next call) adds them and writes
    y: one launch, no reduce. y holds two row-major outputs back to back (_out_offsets): columns
    [0, N1) and [N1, N)."""
    wait_and_release(PDL)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask, mmask = n < N, m < M
    xg = x_ptr + (pid_n * BLOCK_N // ROWS) * K  # BLOCK_N divides ROWS: one group per tile
    ug = u_ptr + (pid_n * BLOCK_N // ROWS) * K  # ACT: the SwiGLU's up half (one group)
    s_row = s_ptr + (n // B) * tl.cdiv(K, B)  # hoisted: one scale per weight row per B-wide K block
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    rstd = _rows_rstd(x_ptr, m, mmask, X_STRIDE, K, norm_eps, NORM)[None, :]  # NORM: ungrouped, so xg is x_ptr
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if BLOCK_K <= B:  # each step inside one scale block (V4): one scale per weight row per step
        # the block scales one step ahead: loaded in the loop and used after its MMA, a scale load's L2
        # latency sat between the MMA and the rescale of every step (SASS: LDG, HGMMA, wait, FFMA)
        sw = tl.load(s_row + k_lo // B, mask=nmask, other=0.0)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_hi
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xt = _x_tile(xg, ug, m[None, :] * X_STRIDE + k[:, None], kmask[:, None] & mmask[None, :], act_limit, ACT,
                         nw_ptr, k[:, None], rstd, NORM)
            sw_next = tl.load(s_row + tl.minimum(k0 + BLOCK_K, k_hi - 1) // B, mask=nmask, other=0.0)  # last: unused
            acc += _scaled_dot(w, xt, sw, DOT_F32, W_CVT)
            sw = sw_next
    elif SCALE_TILE:  # smaller scale blocks, one MMA per step: the tile scaled in float32 (each weight's
        # own block scale), rounded once to the activations' dtype: kernels.reference.linear's weight
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_hi
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
            xt = _x_tile(xg, ug, m[None, :] * X_STRIDE + k[:, None], kmask[:, None] & mmask[None, :], act_limit, ACT,
                         nw_ptr, k[:, None], rstd, NORM)
            st = tl.load(s_row[:, None] + k[None, :] // B, mask=wmask, other=0.0)
            if DOT_F32:
                acc += tl.dot(w.to(tl.float32) * st, xt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot((w.to(tl.float32) * st).to(xt.dtype), xt)
    else:  # smaller scale blocks (V4.1's 32): the step's BLOCK_K bytes per row as BLOCK_K / B sub-steps
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // B):
                k = k0 + j * B + tl.arange(0, B)
                kmask = k < k_hi
                w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                xt = _x_tile(xg, ug, m[None, :] * X_STRIDE + k[:, None], kmask[:, None] & mmask[None, :],
                             act_limit, ACT, nw_ptr, k[:, None], rstd, NORM)
                # past k_hi (a split's or K's end) the tile is masked to zero: any in-bounds scale does
                sw = tl.load(s_row + tl.minimum(k0 + j * B, k_hi - 1) // B, mask=nmask, other=0.0)
                acc += _scaled_dot(w, xt, sw, DOT_F32, W_CVT)
    _split_k_store(acc, y_ptr, ws_ptr, sem_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k,
                   _out_offsets(m[None, :], n[:, None], M, N, N1), nmask[:, None] & mmask[None, :], M, N, SPLITS)


@triton.jit
def _split_k_store(acc, y_ptr, ws_ptr, tile, pid_k, out, omask, M, N, SPLITS: tl.constexpr):
    """Write this split's float32 partial `acc` of y's entries `out`; the last split of the tile to
    finish adds every split's partial in split order (the same sum whichever split is last: the
    order used to start from the last one's own, so equal inputs could round differently run to
    run) and writes y."""
    if SPLITS > 1:
        if split_k_arrive(ws_ptr, out, omask, acc, tile, pid_k, M * N, SPLITS):
            acc = split_k_total(ws_ptr, out, omask, acc, pid_k, M * N, SPLITS)
            tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gemv_weights(w_ptr, s_row, n, nmask, k0, k_hi, K, G: tl.constexpr, B: tl.constexpr, SCALED: tl.constexpr):
    """One K step's weight tile [BLOCK_N, G, B] (e4m3; bf16 where not SCALED), its k offsets [G, B] and their
    scales [BLOCK_N, G] (not SCALED: 1)."""
    k = k0 + tl.arange(0, G)[:, None] * B + tl.arange(0, B)[None, :]
    kmask = k < k_hi
    w = tl.load(w_ptr + n[:, None, None] * K + k[None, :, :], mask=nmask[:, None, None] & kmask[None, :, :],
                other=0.0)
    if SCALED:
        sw = tl.load(s_row[:, None] + k0 // B + tl.arange(0, G)[None, :],
                     mask=nmask[:, None] & (k0 + tl.arange(0, G) * B < k_hi)[None, :], other=0.0)
    else:
        sw = tl.full((n.shape[0], G), 1.0, tl.float32)
    return w, k, sw


@triton.jit
def _gemv_step(xg, ug, n, w, k, sw, k_hi, act_limit, ACT: tl.constexpr, nw_ptr, rstd, NORM: tl.constexpr):
    # x in the weight tile's layout (each thread its own entries, from L1): no shared-memory broadcast
    xk = _x_tile(xg, ug, k[None, :, :] + 0 * n[:, None, None], (k < k_hi)[None, :, :], act_limit, ACT, nw_ptr,
                 k[None, :, :], rstd, NORM).to(tl.float32)
    return tl.sum(tl.sum(w.to(tl.float32) * xk, axis=2) * sw, axis=1)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, sem_ptr, M, N, N1, K, X_STRIDE, ROWS, K_SPLIT, u_ptr,
                 act_limit, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 B: tl.constexpr = 128, ACT: tl.constexpr = False, nw_ptr=None, norm_eps=0.0,
                 NORM: tl.constexpr = False, PDL: tl.constexpr = False, SCALED: tl.constexpr = True):
    """y[m, n-tile] for one activation row m per program, on the CUDA cores: no MMA and no shared
    memory, the weight in 16-byte loads straight to registers ([BLOCK_N, BLOCK_K / B, B]: the last
    axis one scale block, B = 128 in V4, 32 in V4.1), e4m3 -> float32 (F2FP unpack + HADD2.F32), one
    FMA per weight byte, each scale block's sum rescaled once. Groups and split-K as _dequant_kernel.
    PDL: the program's first weight step is loaded before the grid-dependency wait (no kernel writes
    weights), so its bytes stream while the predecessor finishes. ACT: x is a SwiGLU's gate, u_ptr its up
    (_x_tile: the activation computed in the prologue, no separate SwiGLU launch). NORM: x's RMSNorm (weight
    nw_ptr) in the prologue, its row's rms read after the wait (no separate RMSNorm launch). Not SCALED: a bf16
    weight, no scales (s_ptr unread; B only the tile's inner width): kernels/bf16_gemv.py."""
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = BLOCK_K // B
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    xg = x_ptr + m * X_STRIDE + (pid_n * BLOCK_N // ROWS) * K  # BLOCK_N divides ROWS: one group per tile
    ug = u_ptr + m * X_STRIDE + (pid_n * BLOCK_N // ROWS) * K
    s_row = s_ptr + (n // B) * tl.cdiv(K, B)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    if PDL:  # the first step peeled: its weights in flight across the wait (every split has one step)
        w, k, sw = _gemv_weights(w_ptr, s_row, n, nmask, k_lo, k_hi, K, G, B, SCALED)
        wait_and_release(PDL)
        rstd = tl.sum(_rows_rstd(x_ptr, m + tl.arange(0, 1), tl.full((1,), 1, tl.int1), X_STRIDE, K, norm_eps, NORM),
                      axis=0)
        acc += _gemv_step(xg, ug, n, w, k, sw, k_hi, act_limit, ACT, nw_ptr, rstd, NORM)
        k_next = k_lo + BLOCK_K
    else:
        rstd = tl.sum(_rows_rstd(x_ptr, m + tl.arange(0, 1), tl.full((1,), 1, tl.int1), X_STRIDE, K, norm_eps, NORM),
                      axis=0)
        k_next = k_lo
    for k0 in range(k_next, k_hi, BLOCK_K):
        w, k, sw = _gemv_weights(w_ptr, s_row, n, nmask, k0, k_hi, K, G, B, SCALED)
        acc += _gemv_step(xg, ug, n, w, k, sw, k_hi, act_limit, ACT, nw_ptr, rstd, NORM)
    _split_k_store(acc, y_ptr, ws_ptr, sem_ptr + m * tl.num_programs(0) + pid_n, pid_k,
                   _out_offsets(m, n, M, N, N1), nmask, M, N, SPLITS)


@triton.jit(do_not_specialize=["M", "M_OUT"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_x, BLOCK_M: tl.constexpr, ROUND_F32: tl.constexpr,
                      PDL: tl.constexpr = False):
    """x [M, K] (row stride stride_x) -> q [M_OUT, K] e4m3 (float32 holding e4m3 values in the interpreter), scales
    [cdiv(K,128), M_OUT]; rows M..M_OUT quantize zeros (padding)."""
    wait_and_release(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    k = kb * 128 + tl.arange(0, 128)
    mask = (m[:, None] < M_OUT) & (k[None, :] < K)
    a = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mask & (m[:, None] < M), other=0.0).to(tl.float32)
    bits = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12).to(tl.int32, bitcast=True)
    j = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # kernels.formats.act_scale_1x128
    j = tl.minimum(tl.maximum(j, 1), 253)
    inv = ((254 - j) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    if ROUND_F32:
        q = _round_e4m3(a * inv[:, None])
    else:
        q = (a * inv[:, None]).to(tl.float8e4nv)
    tl.store(q_ptr + m[:, None] * K + k[None, :], q, mask=mask)
    tl.store(s_ptr + kb * M_OUT + m, (j << 23).to(tl.float32, bitcast=True), mask=m < M_OUT)


@triton.jit(do_not_specialize=["M"])
def _mma_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, y_ptr, M, N, N1, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, B: tl.constexpr = 128, PDL: tl.constexpr = False):
    """y = dequant(q) @ dequant(W)^T over 128-wide K blocks (the activation scale's); B: the weight's
    scale block (128 V4; 32 V4.1: each K block as 128 / B sub-dots, each rescaled by its own scales)."""
    wait_and_release(PDL)
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # GROUP_M row tiles walk the N tiles together: weight tiles are reused from L2
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    sk = tl.cdiv(K, 128)
    skw = tl.cdiv(K, B)  # weight scale columns
    s_row = s_ptr + (n // B) * skw
    s_tile = s_ptr + (pid_n * BLOCK_N // B) * skw  # BLOCK_N divides B: the tile's rows share one weight scale
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, sk):
        if B == 128:
            k = kb * 128 + tl.arange(0, 128)
            kmask = k < K
            a = tl.load(q_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            sa = tl.load(qs_ptr + kb * M + m, mask=mmask, other=0.0)
            if DOT_F32:  # the interpreter: e4m3 values held in float32, multiplied in float32 (same products)
                d = tl.dot(a, tl.trans(w.to(tl.float32)))
            else:
                d = tl.dot(a, tl.trans(w))
            if 128 % BLOCK_N == 0:  # the rescale is one FMA per accumulator element (SASS: FFMA, no FMUL)
                acc += d * (sa * tl.load(s_tile + kb))[:, None]
            else:
                acc += d * (sa[:, None] * tl.load(s_row + kb, mask=nmask, other=0.0)[None, :])
        else:
            sa = tl.load(qs_ptr + kb * M + m, mask=mmask, other=0.0)
            for j in tl.static_range(128 // B):
                k = kb * 128 + j * B + tl.arange(0, B)
                kmask = k < K
                a = tl.load(q_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                if DOT_F32:
                    d = tl.dot(a, tl.trans(w.to(tl.float32)))
                else:
                    d = tl.dot(a, tl.trans(w))
                c = tl.minimum(kb * (128 // B) + j, skw - 1)  # this sub-block's scale column (past K its dot is 0)
                if B % BLOCK_N == 0:
                    acc += d * (sa * tl.load(s_tile + c))[:, None]
                else:
                    acc += d * (sa[:, None] * tl.load(s_row + c, mask=nmask, other=0.0)[None, :])
    tl.store(y_ptr + _out_offsets(m[:, None], n[None, :], M, N, N1), acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _split_k(cfg: dict, m: int, n: int, k: int) -> int:
    """Split-K so the grid is about WAVES waves (2: a narrow weight at one row has a few dozen N
    tiles), each split at least MIN_STEPS K steps long (4; the gemv: 1, its bytes in flight come
    from many small programs per multiprocessor, 40 registers each)."""
    kblocks = triton.cdiv(k, cfg["BLOCK_K"])
    if cfg.get("SPLIT_K"):
        return max(1, min(cfg["SPLIT_K"], kblocks))
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
    return max(1, min(triton.cdiv(cfg.get("WAVES", 2) * quant_configs.SMS, tiles), kblocks // cfg.get("MIN_STEPS", 4)))


def _launch_opts(cfg: dict) -> dict:
    return {} if _INTERPRET else {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}


def _dequant(x2, weight, scale, y, cfg, groups: int = 1, n1: int | None = None, gemv: bool = False,
             block: int = FP8_BLOCK, act: tuple | None = None, norm: tuple | None = None):
    """x2 [M, groups * K] (row stride x2.stride(0)), weight [N, K] in `groups` blocks of N / groups rows;
    the MMA GEMV (_dequant_kernel) or, gemv, the CUDA-core one (_gemv_kernel, one row per program).
    block: the weight's scale block (kernels.formats.fp8_block_of); scale None (gemv only): a bf16 weight, block
    the K step's inner width. act: (up, limit): x2 is a SwiGLU's gate.
    norm: (weight, eps): x2's RMSNorm is what multiplies W (ungrouped)."""
    if scale is None and not gemv:
        raise ValueError("only the CUDA-core GEMV takes a weight without scales")
    M = x2.shape[0]
    N, K = weight.shape
    if gemv:
        cfg = {**cfg, "BLOCK_M": 1, "WAVES": cfg.get("WAVES", 8), "MIN_STEPS": cfg.get("MIN_STEPS", 1)}
    split = _split_k(cfg, M, N, K)
    k_split = triton.cdiv(triton.cdiv(K, cfg["BLOCK_K"]), split) * cfg["BLOCK_K"]
    split = triton.cdiv(K, k_split)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), split)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=y.device) if split > 1 else y
    sem = semaphores(y.device, grid[0] * grid[1]) if split > 1 else y
    up, limit = act if act is not None else (x2, 0.0)
    args = (x2, weight, weight if scale is None else scale, y, ws, sem, M, N, N if n1 is None else n1, K, x2.stride(0),
            N // groups, k_split, up, float(limit), split)
    nw, eps = norm if norm is not None else (x2, 0.0)
    prologue = {"ACT": act is not None, "nw_ptr": nw, "norm_eps": float(eps), "NORM": norm is not None}
    if gemv:
        _gemv_kernel[grid](*args, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], B=block, **prologue,
                           SCALED=scale is not None, **_launch_opts(cfg), **pdl.options(x2))
        return
    _dequant_kernel[grid](*args, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                          DOT_F32=_INTERPRET or x2.dtype == torch.float32,
                          W_CVT=cfg.get("W_CVT", quant_configs.W_CVT) if x2.dtype == torch.bfloat16 else "cast",
                          B=block, SCALE_TILE=cfg.get("SCALE_TILE", False), **prologue, **_launch_opts(cfg),
                          **pdl.options(x2))


def _mma(x2, weight, scale, y, cfg, n1: int | None = None, block: int = FP8_BLOCK):
    M, K = x2.shape
    N = weight.shape[0]
    sk = triton.cdiv(K, 128)
    q = torch.empty(M, K, dtype=torch.float32 if _INTERPRET else torch.float8_e4m3fn, device=x2.device)
    qs = torch.empty(sk, M, dtype=torch.float32, device=x2.device)
    _act_quant_kernel[(triton.cdiv(M, 32), sk)](x2, q, qs, M, M, K, K, BLOCK_M=32, ROUND_F32=_INTERPRET,
                                                **pdl.options(x2))
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _mma_kernel[grid](q, qs, weight, scale, y, M, N, N if n1 is None else n1, K, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      GROUP_M=cfg.get("GROUP_M", 8), DOT_F32=_INTERPRET, B=block, **_launch_opts(cfg),
                      **pdl.options(q))


def cublas_min_rows() -> int:
    """Rows from which a V4 FP8 linear takes cuBLAS's blockwise GEMM (kernel variant fp8_cublas_mid: from fewer)."""
    return quant_configs.FP8_CUBLAS_MID_ROWS if variants.on("fp8_cublas_mid") else quant_configs.FP8_CUBLAS_MIN_ROWS


def tiles(m: int, n: int, k: int, variant: str | None = None, config: dict | None = None,
          block: int = FP8_BLOCK) -> tuple[str, dict]:
    """(variant, config) of one call: `config` (a sweep's) or the table's for the shape; a variant asked for by
    name where the table picks another for the shape takes that variant's own tiles. block: the weight's
    scale block; the table's "mma" for blocks narrower than MMA_MIN_BLOCK becomes "unpacked"."""
    asked = variant or config and config.get("variant")
    cfg = dict(config or quant_configs.fp8_linear_config(m, n, k))
    variant = asked or variant_for(m, n, k)
    if variant == "mma" and block < MMA_MIN_BLOCK and not asked:
        variant = "unpacked"
    if variant in ("mma", "dequant") and block == FP8_BLOCK and not asked and CUBLAS_OK \
            and m >= cublas_min_rows() and k % CUBLAS_K_ALIGN == 0 and n % FP8_BLOCK == 0 \
            and quant_configs.hopper():
        variant = "cublas"
    if variant not in VARIANTS:
        raise ValueError(f"fp8 linear variant must be one of {VARIANTS}, got {variant!r}")
    if config is None and cfg.get("variant", variant) != variant:
        cfg = dict(quant_configs.FP8_VARIANT_TILES[variant])
    return variant, cfg


def group_tiles(cfg: dict, rows: int) -> dict:
    """The table's GEMV tiles for one group of `rows` rows (a multiple of the scale block): a BLOCK_N wider than
    the group (V4.1's wo_a at 8-way tensor parallelism has 32 rows a group) would straddle two groups, so it
    narrows to the largest power of two dividing both."""
    if rows % cfg["BLOCK_N"] == 0:
        return cfg
    return {**cfg, "BLOCK_N": math.gcd(rows, cfg["BLOCK_N"])}


def per_group_split(m: int, rows: int, k: int, block: int = FP8_BLOCK) -> dict | None:
    """The tiles a grouped linear's per-group call of m rows takes (one group of `rows` rows), its K split pinned
    (SPLIT_K): one grouped launch with them runs the per-group launches' programs, each the same K range in the same
    split order (the same sums), side by side. None where that call is no GEMV ("mma", cuBLAS) or its tile would
    straddle two groups."""
    variant, cfg = tiles(m, rows, k, block=block)
    if variant != "dequant" or rows % cfg["BLOCK_N"]:
        return None
    return {**cfg, "variant": variant, "SPLIT_K": _split_k(cfg, m, rows, k)}


def takes_prologue(m: int, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether fp8_linear_fused computes a SwiGLU (`act`) or an RMSNorm (`norm`) in its prologue at m rows: the
    GEMV variants do."""
    n, k = weight.shape
    return tiles(m, n, k, block=fp8_block_of(weight.shape, scale.shape))[0] in ("gemv", "dequant")


def fp8_linear_fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, variant: str | None = None,
                     config: dict | None = None, groups: int = 1, split_n: int | None = None,
                     act: tuple[torch.Tensor, float] | None = None, norm: tuple[torch.Tensor, float] | None = None):
    """x [..., K] (bf16 / fp16 / fp32), weight e4m3 [N, K], scale float32 [cdiv(N,b), cdiv(K,b)], b the
    block (kernels.formats.fp8_block_of: 128 V4, 32 V4.1).
    groups > 1 (wo_a): x [..., groups, K] and weight [groups * R, K], group g's rows times x's
    group g -> [..., groups * R] (R a multiple of b); "dequant" does all groups in one launch.
    split_n (two linears of x stacked along N, e.g. wq_a over wkv): the pair (x @ W[:split_n]^T,
    x @ W[split_n:]^T), each contiguous, from one launch.
    `config` (tools/bench_quant.py's sweep) overrides kernels/quant_configs.py's entry.
    act (up, limit): x is a SwiGLU's gate; the clamped SwiGLU of (x, up) is what multiplies W, computed in
    the GEMV's prologue (variants gemv and dequant only: takes_prologue; ungrouped, unsplit).
    norm (weight, eps): what multiplies W is x's RMSNorm (kernels.reference.rms_norm: float32 weight [K]),
    computed in the GEMV's prologue (the same variants; ungrouped; not with act)."""
    if act is not None and (groups > 1 or split_n is not None or act[0].shape != x.shape):
        raise ValueError("a SwiGLU prologue takes one ungrouped, unsplit linear and an up of the gate's shape")
    if norm is not None and (groups > 1 or act is not None or norm[0].shape != (x.shape[-1],)):
        raise ValueError(f"an RMSNorm prologue takes one ungrouped linear, no SwiGLU, and a weight of shape "
                         f"({x.shape[-1]},), got {tuple(norm[0].shape)}")
    if groups > 1:
        lead, K = x.shape[:-2], x.shape[-1]
    else:
        *lead, K = x.shape
    N = weight.shape[0]
    if split_n is not None and (groups > 1 or not 0 < split_n < N):
        raise ValueError(f"split_n must be in (0, {N}) for an ungrouped linear, got {split_n} (groups {groups})")
    x2 = x.reshape(-1, groups * K)
    M = x2.shape[0]
    if M == 0:
        return _outputs(torch.empty(0, dtype=x.dtype, device=x.device), lead, M, N, split_n)
    block = fp8_block_of(weight.shape, scale.shape)
    if groups > 1 and (N // groups) % block:
        raise ValueError(f"grouped FP8 linear: {N // groups} rows per group are not whole {block}-row scale blocks")
    variant, cfg = tiles(M, N // groups, K, variant, config, block)  # per group: the tiles see one group
    if groups > 1 and variant in ("dequant", "gemv") and config is None:
        cfg = group_tiles(cfg, N // groups)
    if (act is not None or norm is not None) and variant not in ("dequant", "gemv"):
        raise ValueError(f"a prologue needs the gemv or dequant variant, not {variant!r} (takes_prologue)")
    if not x2.is_contiguous() and (x2.stride(-1) != 1 or act is not None or variant in ("mma", "unpacked")):
        # the GEMVs and cuBLAS's activation quantization read rows at any stride (wo_a's per-group calls pass one
        # group's columns in place: a copy a group each step, 8 launches a layer, saved); a SwiGLU's up shares x's
        # row offsets, and "mma" / "unpacked" read x as [M, K]
        x2 = x2.contiguous()
    if norm is not None:
        norm = (norm[0].float().contiguous(), norm[1])
    if act is not None:
        up = act[0].reshape(-1, K)
        act = (up if up.is_contiguous() else up.contiguous(), act[1])
    if variant == "unpacked":
        return _unpacked(x2, weight, scale, lead, M, N, K, groups, split_n)
    if variant == "cublas":
        return _cublas(x2, weight, scale, lead, M, N, K, groups, split_n)
    if _INTERPRET:
        cfg.update(quant_configs.INTERPRET_LINEAR[variant])
    y = torch.empty(M * N, dtype=x.dtype, device=x.device)
    if variant == "dequant":
        cfg.setdefault("BLOCK_K", 128)
        if max(block, cfg["BLOCK_K"]) % min(block, cfg["BLOCK_K"]):
            raise ValueError(f"dequant steps must sit inside {block}x{block} scale blocks or hold whole ones: {cfg}")
    if variant == "gemv" and cfg.get("BLOCK_K", 0) % block:
        raise ValueError(f"gemv steps must be whole {block}-wide scale blocks: {cfg}")
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        scale = scale.float().contiguous()
    if variant in ("dequant", "gemv"):
        if groups > 1 and (N // groups) % cfg["BLOCK_N"]:
            raise ValueError(f"grouped {variant} tiles must not straddle groups: {N // groups} rows, {cfg}")
        _dequant(x2, weight, scale, y, cfg, groups, split_n, gemv=variant == "gemv", block=block, act=act, norm=norm)
    elif groups == 1:
        _mma(x2, weight, scale, y, cfg, split_n, block)
    else:  # the FP8 tensor-core kernel takes one group at a time
        R, blk = N // groups, N // groups // block
        for g in range(groups):
            yg = torch.empty(M, R, dtype=x.dtype, device=x.device)
            _mma(x2[:, g * K:(g + 1) * K].contiguous(), weight[g * R:(g + 1) * R], scale[g * blk:(g + 1) * blk], yg, cfg,
                 block=block)
            y.view(M, N)[:, g * R:(g + 1) * R] = yg
    return _outputs(y, lead, M, N, split_n)


def _unpacked(x2, weight, scale, lead, M: int, N: int, K: int, groups: int, split_n: int | None):
    """The "unpacked" variant: the weight unpacked to x's dtype (kernels/fp8_unpack.py), then torch's
    GEMM; the same arithmetic as kernels.reference.linear."""
    w = fp8_unpacked(weight, scale, x2.dtype)
    if groups > 1:  # x [M, groups, K] against each group's [R, K] rows
        y = torch.bmm(x2.view(M, groups, K).transpose(0, 1), w.view(groups, N // groups, K).transpose(1, 2))
        return y.transpose(0, 1).reshape(*lead, groups, N // groups).flatten(-2)
    if split_n is None:
        return torch.nn.functional.linear(x2, w).view(*lead, N)
    return (torch.nn.functional.linear(x2, w[:split_n]).view(*lead, split_n),
            torch.nn.functional.linear(x2, w[split_n:]).view(*lead, N - split_n))


def _cublas(x2, weight, scale, lead, M: int, N: int, K: int, groups: int, split_n: int | None):
    """The "cublas" variant: activations quantized per 1x128 block by _act_quant_kernel (the "mma" variant's
    rounding, reading each group's columns in place), then torch's blockwise scaled_mm. cuBLAS wants the
    activation scales M-major with M a multiple of 4 (zero rows pad the activations, their outputs dropped) and
    whole groups of 4 K blocks (tiles() takes this variant only where K has them). A stacked pair (split_n on a
    block boundary) runs as two GEMMs on the weight's row ranges, sharing the quantized activations, so each output
    comes out contiguous (slicing one result's columns cost two strided copies)."""
    F = torch.nn.functional
    sk, Mp, R = triton.cdiv(K, 128), M + (-M % 4), N // groups
    ws = scale.float().contiguous()
    pair = split_n is not None and split_n % FP8_BLOCK == 0  # split_n comes with groups == 1
    ys = []
    for g in range(groups):  # wo_a: its group's columns of x, one GEMM per group, as "mma"
        q = torch.empty(Mp, K, dtype=torch.float8_e4m3fn, device=x2.device)
        qs = torch.empty(sk, Mp, dtype=torch.float32, device=x2.device)
        _act_quant_kernel[(triton.cdiv(Mp, 32), sk)](x2[:, g * K:], q, qs, M, Mp, K, x2.stride(0), BLOCK_M=32,
                                                     ROUND_F32=False, **pdl.options(x2))
        for a, b in [(0, split_n), (split_n, N)] if pair else [(g * R, (g + 1) * R)]:
            ys.append(F.scaled_mm(q, weight[a:b].t(), qs.t(), F.ScalingType.BlockWise1x128,
                                  ws[a // FP8_BLOCK:triton.cdiv(b, FP8_BLOCK)].t(), F.ScalingType.BlockWise128x128,
                                  output_dtype=x2.dtype)[:M])
    if pair:
        return ys[0].view(*lead, split_n), ys[1].view(*lead, N - split_n)
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    if split_n is None:
        return y.reshape(*lead, N)
    return y[:, :split_n].contiguous().view(*lead, split_n), y[:, split_n:].contiguous().view(*lead, N - split_n)


def _outputs(y, lead, M: int, N: int, split_n: int | None):
    if split_n is None:
        return y.view(*lead, N)
    return y[:M * split_n].view(*lead, split_n), y[M * split_n:].view(*lead, N - split_n)
