"""Fused Triton kernels: RMSNorm, mHC pre (mix GEMV + Sinkhorn + collapse) and post, router gate.

Each `*_fused` function has the signature of its torch reference in kernels/reference.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# --- RMSNorm ----------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                     HAS_W=True, BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view_as(x)


def rms_norm_unweighted_fused(x: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                     HAS_W=False, BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view_as(x)


# --- mHC pre: split-K mixing GEMV (+ the RMS) over many programs, then one kernel that reduces
# the partials, runs Sinkhorn in registers and collapses the 4 streams ---------------------------

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# fp32-accurate tensor-core dots (3 tf32 passes); the interpreter knows only "ieee"
_PRECISION = "ieee" if _INTERPRET else "tf32x3"


@triton.jit(do_not_specialize=["T"])
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, T, K, K_SPLIT, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """part[split, t, 0:24] = x[t, ks] @ fn[:, ks]^T, part[split, t, 24] = sum x[t, ks]^2"""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tmask = t < T
    r32 = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_T, 32), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    k_lo = split * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        f = tl.load(fn_ptr + r32[:, None] * K + k[None, :], mask=(r32[:, None] < 24) & kmask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(f), input_precision=PRECISION)
    acc = tl.where(r32[None, :] == 24, sumsq[:, None], acc)
    tl.store(part_ptr + (split * T + t[:, None]) * 32 + r32[None, :], acc, mask=tmask[:, None] & (r32[None, :] < 25))


@triton.jit(do_not_specialize=["T"])
def _hc_finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, T, D, N_SPLIT, hc_eps,
                      norm_eps, ITERS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    HC: tl.constexpr = 4
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pid_d = tl.program_id(1)
    tmask = t < T
    r16 = tl.arange(0, 16)
    pre_w = tl.zeros((BLOCK_T, 16), tl.float32)
    post_w = tl.zeros((BLOCK_T, 16), tl.float32)
    comb_w = tl.zeros((BLOCK_T, 16), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    small = tmask[:, None] & (r16[None, :] < HC)
    for sp in range(N_SPLIT):
        row = part_ptr + (sp * T + t[:, None]) * 32
        pre_w += tl.load(row + r16[None, :], mask=small, other=0.0)
        post_w += tl.load(row + HC + r16[None, :], mask=small, other=0.0)
        comb_w += tl.load(row + 2 * HC + r16[None, :], mask=tmask[:, None], other=0.0)
        sumsq += tl.load(part_ptr + (sp * T + t) * 32 + 24, mask=tmask, other=0.0)
    # the unweighted RMSNorm of the flattened streams is one scalar per token: it factors out
    r = tl.rsqrt(sumsq / (HC * D) + norm_eps)[:, None]
    b_pre = tl.load(base_ptr + r16, mask=r16 < HC, other=0.0)
    pre = tl.sigmoid(pre_w * r * tl.load(scale_ptr) + b_pre[None, :]) + hc_eps
    if pid_d == 0:
        b_post = tl.load(base_ptr + HC + r16, mask=r16 < HC, other=0.0)
        post = 2 * tl.sigmoid(post_w * r * tl.load(scale_ptr + 1) + b_post[None, :])
        logits = comb_w * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + r16)[None, :]
        logits = tl.reshape(logits, (BLOCK_T, HC, HC))
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):  # Sinkhorn-Knopp, in registers
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t[:, None] * 16 + r16[None, :], tl.reshape(comb, (BLOCK_T, 16)), mask=tmask[:, None])
        tl.store(post_ptr + t[:, None] * HC + r16[None, :], post, mask=small)
    p0 = tl.sum(tl.where(r16[None, :] == 0, pre, 0.0), axis=1)[:, None]
    p1 = tl.sum(tl.where(r16[None, :] == 1, pre, 0.0), axis=1)[:, None]
    p2 = tl.sum(tl.where(r16[None, :] == 2, pre, 0.0), axis=1)[:, None]
    p3 = tl.sum(tl.where(r16[None, :] == 3, pre, 0.0), axis=1)[:, None]
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tmask[:, None] & (d[None, :] < D)
    base = x_ptr + t[:, None] * (HC * D) + d[None, :]
    y = p0 * tl.load(base, mask=m, other=0.0).to(tl.float32)
    y += p1 * tl.load(base + D, mask=m, other=0.0).to(tl.float32)
    y += p2 * tl.load(base + 2 * D, mask=m, other=0.0).to(tl.float32)
    y += p3 * tl.load(base + 3 * D, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


FINISH_WARPS = 4  # tuning knob for the Sinkhorn/collapse kernel (tools/tune_small_kernels.py)


def hc_pre_fused(x, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    T, hc, D = x.shape
    assert hc == 4, "the fused mHC kernel is written for 4 streams (DeepSeek-V4's hc_mult)"
    x = x.contiguous()
    K = hc * D
    BLOCK_T, BLOCK_K = 16, min(128, triton.next_power_of_2(K))
    n_split = max(1, min(64, triton.cdiv(K, BLOCK_K)))  # enough programs to fill the GPU at T = 1
    k_split = triton.cdiv(triton.cdiv(K, n_split), BLOCK_K) * BLOCK_K
    n_split = triton.cdiv(K, k_split)
    part = torch.empty(n_split, T, 32, dtype=torch.float32, device=x.device)
    _hc_mix_partial_kernel[(triton.cdiv(T, BLOCK_T), n_split)](
        x, fn.float().contiguous(), part, T, K, k_split, PRECISION=_PRECISION, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K)
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    BLOCK_D = min(512, triton.next_power_of_2(D))
    _hc_finish_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))](
        x, part, base.float().contiguous(), scale.float().contiguous(), post, comb, out, T, D, n_split, hc_eps,
        norm_eps, ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=FINISH_WARPS)
    return post, comb, out


@triton.jit
def _hc_post_kernel(x_ptr, blk_ptr, post_ptr, comb_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    """out[t, k, :] = post[t, k] * blk[t, :] + sum_j comb[t, j, k] * x[t, j, :]"""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    b = tl.load(blk_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + (t * 4 + 0) * D + d, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + (t * 4 + 1) * D + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + (t * 4 + 2) * D + d, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptr + (t * 4 + 3) * D + d, mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(4):
        y = tl.load(post_ptr + t * 4 + k) * b
        y += tl.load(comb_ptr + t * 16 + 0 * 4 + k) * x0
        y += tl.load(comb_ptr + t * 16 + 1 * 4 + k) * x1
        y += tl.load(comb_ptr + t * 16 + 2 * 4 + k) * x2
        y += tl.load(comb_ptr + t * 16 + 3 * 4 + k) * x3
        tl.store(out_ptr + (t * 4 + k) * D + d, y.to(out_ptr.dtype.element_ty), mask=m)


def hc_post_fused(x, out, post, comb):
    T, hc, D = x.shape
    assert hc == 4
    res = torch.empty_like(x)
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    _hc_post_kernel[(T, triton.cdiv(D, BLOCK_D))](x.contiguous(), out.contiguous(), post.float().contiguous(),
                                                  comb.float().contiguous(), res, D, BLOCK_D=BLOCK_D)
    return res


# --- router gate: scores, selection bias, top-k, renormalise, scale in one program per token ---

@triton.jit
def _router_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                   SCORING: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    x = tl.load(logits_ptr + t * E + e, mask=m, other=0.0).to(tl.float32)
    if SCORING == 0:  # sqrt(softplus(x)), softplus as torch computes it (linear above 20)
        s = tl.sqrt(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))
    elif SCORING == 1:
        s = tl.sigmoid(x)
    else:
        z = tl.exp(x - tl.max(tl.where(m, x, -float("inf")), axis=0))
        z = tl.where(m, z, 0.0)
        s = z / tl.sum(z, axis=0)
    sel = tl.where(m, s + tl.load(bias_ptr + e, mask=m, other=0.0), -float("inf"))
    kr = tl.arange(0, KP)
    ws = tl.zeros((KP,), tl.float32)
    ids = tl.zeros((KP,), tl.int64)
    for j in tl.static_range(K):  # k rounds of argmax: k is small (6 of 256 in V4)
        best = tl.max(sel, axis=0)
        i = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
        ws = tl.where(kr == j, tl.sum(tl.where(e == i, s, 0.0), axis=0), ws)
        ids = tl.where(kr == j, i.to(tl.int64), ids)
        sel = tl.where(e == i, -float("inf"), sel)
    ws = ws / (tl.sum(ws, axis=0) + 1e-20) * scaling
    tl.store(w_ptr + t * K + kr, ws, mask=kr < K)
    tl.store(idx_ptr + t * K + kr, ids, mask=kr < K)


_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def router_topk_fused(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids=None):
    if hash_ids is not None or bias is None:
        from kernels.reference import router_topk  # hash routing is a gather; odd k: reference
        return router_topk(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids)
    logits = torch.nn.functional.linear(x, weight).contiguous()  # the GEMM stays on cuBLAS
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    _router_kernel[(T,)](logits, bias.float().contiguous(), w, idx, E, routed_scaling, K=top_k,
                         KP=triton.next_power_of_2(top_k),
                         SCORING=_SCORING[scoring_func], BLOCK_E=triton.next_power_of_2(E))
    return w.to(x.dtype), idx
