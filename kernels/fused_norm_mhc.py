"""Fused Triton kernels: RMSNorm, mHC pre (mix GEMV + Sinkhorn + collapse) and post, router gate.

Each `*_fused` function has the signature of its torch reference in kernels/reference.py.
"""

from __future__ import annotations

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


# --- mHC pre: one pass over the 4 streams for the mixing GEMV and the RMS, Sinkhorn in
# registers, then the weighted collapse ----------------------------------------------------------

@triton.jit
def _hc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, T, D, hc_eps, norm_eps,
                   ITERS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    HC: tl.constexpr = 4
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    K = HC * D
    r16 = tl.arange(0, 16)
    acc_pre = tl.zeros((BLOCK_T, 16), tl.float32)
    acc_post = tl.zeros((BLOCK_T, 16), tl.float32)
    acc_comb = tl.zeros((BLOCK_T, 16), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        # fn rows: 0..3 pre, 4..7 post, 8..23 comb (padded to 16 rows each for tl.dot)
        f_pre = tl.load(fn_ptr + r16[:, None] * K + k[None, :], mask=(r16[:, None] < HC) & kmask[None, :], other=0.0)
        f_post = tl.load(fn_ptr + (r16[:, None] + HC) * K + k[None, :], mask=(r16[:, None] < HC) & kmask[None, :],
                         other=0.0)
        f_comb = tl.load(fn_ptr + (r16[:, None] + 2 * HC) * K + k[None, :], mask=kmask[None, :], other=0.0)
        acc_pre += tl.dot(x, tl.trans(f_pre), input_precision="ieee")
        acc_post += tl.dot(x, tl.trans(f_post), input_precision="ieee")
        acc_comb += tl.dot(x, tl.trans(f_comb), input_precision="ieee")
    # the unweighted RMSNorm of the flattened streams is one scalar per token: it factors out
    r = tl.rsqrt(sumsq / K + norm_eps)[:, None]
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + r16, mask=r16 < HC, other=0.0)
    b_post = tl.load(base_ptr + HC + r16, mask=r16 < HC, other=0.0)
    b_comb = tl.load(base_ptr + 2 * HC + r16)
    pre = tl.sigmoid(acc_pre * r * s_pre + b_pre[None, :]) + hc_eps
    post = 2 * tl.sigmoid(acc_post * r * s_post + b_post[None, :])
    logits = tl.reshape(acc_comb * r * s_comb + b_comb[None, :], (BLOCK_T, HC, HC))
    logits = logits - tl.max(logits, axis=2)[:, :, None]
    e = tl.exp(logits)
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):  # Sinkhorn-Knopp, in registers
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + t[:, None] * 16 + r16[None, :], tl.reshape(comb, (BLOCK_T, 16)), mask=tmask[:, None])
    tl.store(post_ptr + t[:, None] * HC + r16[None, :], post, mask=tmask[:, None] & (r16[None, :] < HC))
    p0 = tl.sum(tl.where(r16[None, :] == 0, pre, 0.0), axis=1)[:, None]
    p1 = tl.sum(tl.where(r16[None, :] == 1, pre, 0.0), axis=1)[:, None]
    p2 = tl.sum(tl.where(r16[None, :] == 2, pre, 0.0), axis=1)[:, None]
    p3 = tl.sum(tl.where(r16[None, :] == 3, pre, 0.0), axis=1)[:, None]
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = tmask[:, None] & (d[None, :] < D)
        base = x_ptr + t[:, None] * K + d[None, :]
        y = p0 * tl.load(base, mask=m, other=0.0).to(tl.float32)
        y += p1 * tl.load(base + D, mask=m, other=0.0).to(tl.float32)
        y += p2 * tl.load(base + 2 * D, mask=m, other=0.0).to(tl.float32)
        y += p3 * tl.load(base + 3 * D, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t[:, None] * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def hc_pre_fused(x, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    T, hc, D = x.shape
    assert hc == 4, "the fused mHC kernel is written for 4 streams (DeepSeek-V4's hc_mult)"
    x = x.contiguous()
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    BLOCK_T = 16
    _hc_pre_kernel[(triton.cdiv(T, BLOCK_T),)](
        x, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(), post, comb, out, T, D,
        hc_eps, norm_eps, ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T, BLOCK_K=min(128, triton.next_power_of_2(hc * D)),
        BLOCK_D=min(128, triton.next_power_of_2(D)))
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
