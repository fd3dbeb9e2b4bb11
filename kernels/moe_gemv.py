"""The routed experts at one or a few tokens on the CUDA cores: one (token, expert) pair and BLOCK_N weight rows
per program, the weight decoded in registers (kernels/fused_dequant.py) and multiplied by the pair's activation
row with FMAs: no MMA, no shared-memory tile, no row tile padded to 16 for one token (the fused MoE's decode
tiles, kernels/fused_moe.py). Kernel 1: h = swiglu(x @ w1^T, x @ w3^T) per pair; kernel 2: y = (h @ w2^T) *
routing weight per pair; then fused_moe's sum over each token's k rows. Same signature as
kernels.reference.moe_experts; pairs of index -1 (another rank's experts) compute nothing.

Candidate for decode at batch 1 (quant_configs.MOE_GEMV_MAX_TOKENS), timed against the decode tiles by
tools/bench_moe_decode.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import quant_configs
from kernels.fused_dequant import mxfp4_rows_parts_bf16
from kernels.fused_moe import _MX_ASM, _clamped_swiglu, _expert_tile, _sum_topk_kernel, weight_format


@triton.jit
def _part_dot(o, x_row, kw, q: tl.constexpr, K):
    """Part q of a decoded MXFP4 tile ([BLOCK_N, BLOCK_K / 8]: value q of every 8) times the activations it meets."""
    return tl.sum(o.to(tl.float32) * tl.load(x_row + kw + q, mask=kw < K, other=0.0).to(tl.float32)[None, :], axis=1)


@triton.jit
def _step(w_ptr, s_ptr, e, n, k0, N, K, x_row, W_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          ASM: tl.constexpr):
    """Expert e's rows n over K step k0 times x_row[k0:k0 + BLOCK_K], float32 [BLOCK_N]."""
    if W_FMT == 2:
        e64 = e.to(tl.int64)
        o0, o1, o2, o3, o4, o5, o6, o7 = mxfp4_rows_parts_bf16(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32),
                                                               n, k0, N, K, BLOCK_N, BLOCK_K, ASM)
        kw = k0 + 8 * tl.arange(0, BLOCK_K // 8)
        acc = _part_dot(o0, x_row, kw, 0, K) + _part_dot(o1, x_row, kw, 1, K)
        acc += _part_dot(o2, x_row, kw, 2, K) + _part_dot(o3, x_row, kw, 3, K)
        acc += _part_dot(o4, x_row, kw, 4, K) + _part_dot(o5, x_row, kw, 5, K)
        acc += _part_dot(o6, x_row, kw, 6, K) + _part_dot(o7, x_row, kw, 7, K)
    else:
        t, sw = _expert_tile(w_ptr, s_ptr, e, n, k0, N, K, W_FMT, BLOCK_N, BLOCK_K, 0)
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        acc = tl.sum(t.to(tl.float32) * xk[None, :], axis=1) * sw
    return acc


@triton.jit(do_not_specialize=["n_pairs"])
def _gemv_gate_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, idx_ptr, n_pairs, D, I, TOPK, limit,
                         W_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + (p // TOPK).to(tl.int64) * D
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc3 = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        acc1 += _step(w1_ptr, s1_ptr, e, n, k0, I, D, x_row, W_FMT, BLOCK_N, BLOCK_K, ASM)
        acc3 += _step(w3_ptr, s3_ptr, e, n, k0, I, D, x_row, W_FMT, BLOCK_N, BLOCK_K, ASM)
    tl.store(h_ptr + p.to(tl.int64) * I + n, _clamped_swiglu(acc1, acc3, limit).to(h_ptr.dtype.element_ty),
             mask=n < I)


@triton.jit(do_not_specialize=["n_pairs"])
def _gemv_down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, idx_ptr, n_pairs, D, I, W_FMT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_row = h_ptr + p.to(tl.int64) * I
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc += _step(w2_ptr, s2_ptr, e, n, k0, D, I, h_row, W_FMT, BLOCK_N, BLOCK_K, ASM)
    rw = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(y_ptr + p.to(tl.int64) * D + n, acc * rw, mask=n < D)


def moe_experts_gemv(x, w1, w3, w2, weights, indices, limit, scales=None, config: dict | None = None):
    """kernels.reference.moe_experts' signature; `config` ({"BLOCK_N", "BLOCK_K", "num_warps"}, a sweep's)
    overrides quant_configs.MOE_GEMV."""
    T, D = x.shape
    E, I = w1.shape[:2]
    k = indices.shape[1]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    fmt = weight_format(w1, s1)
    if fmt == 1:
        s1, s3, s2 = (s.float().contiguous() for s in (s1, s3, s2))
    elif fmt == 2:
        s1, s3, s2 = (s.contiguous().view(torch.uint8) for s in (s1, s3, s2))
        if any(w.data_ptr() % 16 for w in (w1, w3, w2)):
            raise ValueError("MXFP4 expert weights must start 16-byte aligned")
    else:
        s1 = s3 = s2 = w1  # unused pointers
    cfg = {**quant_configs.MOE_GEMV, **(config or {})}
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if fmt == 1 and 128 % bk or fmt == 2 and bk % 32:
        raise ValueError(f"MoE GEMV BLOCK_K {bk} does not fit the {('dense', 'fp8', 'mxfp4')[fmt]} scale blocks")
    n_pairs = T * k
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if n_pairs == 0:
        return out
    x = x.contiguous()
    idx = indices.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    h = torch.empty(n_pairs, I, dtype=x.dtype, device=x.device)
    y = torch.empty(n_pairs, D, dtype=torch.float32, device=x.device)
    opts = {"num_warps": cfg.get("num_warps", 4)}
    _gemv_gate_up_kernel[(n_pairs, triton.cdiv(I, bn))](x, w1, w3, s1, s3, h, idx, n_pairs, D, I, k, limit,
                                                        W_FMT=fmt, BLOCK_N=bn, BLOCK_K=bk, ASM=_MX_ASM, **opts)
    _gemv_down_kernel[(n_pairs, triton.cdiv(D, bn))](h, w2, s2, y, rw, idx, n_pairs, D, I, W_FMT=fmt, BLOCK_N=bn,
                                                     BLOCK_K=bk, ASM=_MX_ASM, **opts)
    _sum_topk_kernel[(T, triton.cdiv(D, 1024))](y, idx, out, T, D, TOPK=k, BLOCK=1024)
    return out
