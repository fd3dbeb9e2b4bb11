"""Block-scaled FP8 linear y = x @ dequant(W)^T, W e4m3 [N, K] with float32 128x128 block scales.

Two variants (same result up to the activation rounding of the second):
- "dequant": the weight tile is dequantized in registers and multiplied in bf16. Reads half the
  bytes of a bf16 weight: the choice for decode, where the GEMM is memory bound.
- "mma": activations are quantized per 1x128 on the fly (scale: the power of two >= absmax / 448,
  DeepSeek's ue8m0 act_quant; e4m3 values) and the FP8 tensor cores multiply, each 128-wide K
  block rescaled by its activation and weight scales (DeepSeek's fp8_gemm scheme): twice the bf16
  peak, for prefill. Power-of-two scales make the division exact, so the kernel rounds each
  activation exactly as kernels.reference.linear_act_quant does.
`variant_for` picks per shape from DEQUANT_MAX_ROWS, which tools/bench_quant.py measures on the
H200 (its JSON key "crossover").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_dequant import fp8_block_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
# Rows up to which "dequant" runs, per (N, K) weight shape; "default" for the rest. Until the H200
# fills it: the decode batches (<= 64 rows) stay weight-bound, where dequant reads the same bytes.
DEQUANT_MAX_ROWS: dict = {"default": 64}


def variant_for(m: int, n: int, k: int) -> str:
    if not _INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        return "dequant"  # no FP8 tensor cores before Ada / Hopper
    return "dequant" if m <= DEQUANT_MAX_ROWS.get((n, k), DEQUANT_MAX_ROWS["default"]) else "mma"


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


def _configs(block_k: bool):
    """Decode: narrow row tiles streaming wide weight tiles; prefill: 128x128 tiles, 8 warps. The
    dequant variant also picks its K tile (the mma one multiplies whole 128-wide scale blocks)."""
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, **({"BLOCK_K": 64} if block_k else {})})]
    shapes = ((16, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4))
    ks = (64, 128) if block_k else (None,)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **({"BLOCK_K": k} if k else {})}, num_warps=w, num_stages=st)
            for m, n, w, st in shapes for k in ks if not (k == 128 and m >= 64)]


def _row_class(m: int) -> int:
    return 0 if m <= 16 else 1 if m <= 64 else 2 if m <= 512 else 3


@triton.autotune(configs=_configs(block_k=True), key=["N", "K", "ROW_CLASS"])
@triton.jit(do_not_specialize=["M"])
def _dequant_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, ROW_CLASS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = fp8_block_tile(w_ptr, s_ptr, n, k, N, K, 0, 0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), b)
        else:
            acc += tl.dot(a, b.to(a.dtype))
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.autotune(configs=_configs(block_k=False), key=["N", "K", "ROW_CLASS"])
@triton.jit(do_not_specialize=["M"])
def _mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, ROW_CLASS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    sk = tl.cdiv(K, 128)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, sk):
        k = kb * 128 + tl.arange(0, 128)
        a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        a = a.to(tl.float32)
        bits = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12).to(tl.int32, bitcast=True)
        j = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # kernels.formats.act_scale_1x128
        j = tl.minimum(tl.maximum(j, 1), 253)
        sa = (j << 23).to(tl.float32, bitcast=True)
        inv = ((254 - j) << 23).to(tl.float32, bitcast=True)  # 1 / sa, exact
        wmask = (n[None, :] < N) & (k[:, None] < K)
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=wmask, other=0.0)
        sw = tl.load(s_ptr + (n // 128) * sk + kb, mask=n < N, other=0.0)
        if DOT_F32:  # the interpreter: e4m3 values held in float32, multiplied in float32 (same products)
            d = tl.dot(_round_e4m3(a * inv[:, None]), w.to(tl.float32))
        else:
            d = tl.dot((a * inv[:, None]).to(tl.float8e4nv), w)
        acc += d * sa[:, None] * sw[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def fp8_linear_fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, variant: str | None = None):
    """x [..., K] (bf16 / fp16 / fp32), weight e4m3 [N, K], scale float32 [cdiv(N,128), cdiv(K,128)]."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    variant = variant or variant_for(M, N, K)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    scale = scale.float().contiguous()
    if variant == "dequant":
        _dequant_kernel[grid](x2, weight, scale, y, M, N, K, _row_class(M), DOT_F32=_INTERPRET or x.dtype == torch.float32)
    elif variant == "mma":
        _mma_kernel[grid](x2, weight, scale, y, M, N, K, _row_class(M), DOT_F32=_INTERPRET)
    else:
        raise ValueError(f"fp8 linear variant must be 'dequant' or 'mma', got {variant!r}")
    return y.view(*lead, N)
