"""Fused RMSNorm + interleaved RoPE (q per head, kv with the window-cache insert) and plain RoPE.

One program per (token, head) row: the norm's sum of squares over the whole row, then the
nope slice scaled and the rope slice rotated pairwise (2i, 2i+1), in fp32, cast once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fusions, pdl
from kernels.pdl import wait_and_release


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, D, R, HEADS, eps, sin_sign,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, INSERT: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    wait_and_release(PDL)
    row = tl.program_id(0)
    _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, row, row // HEADS, D, R, eps, sin_sign, NORM,
                   HAS_W, INSERT, BLOCK_D, BLOCK_R)


@triton.jit
def _q_kv_norm_rope_kernel(q_ptr, q_out_ptr, kv_ptr, kv_w_ptr, pool_ptr, slot_ptr, cos_ptr, sin_ptr, D, R, HEADS,
                           Q_ROWS, eps, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """Attention's two norm + RoPE rows in one launch: rows below Q_ROWS the query heads (unweighted norm), the
    rest each token's K=V latent (weighted norm, into the window cache at its slot)."""
    wait_and_release(PDL)
    row = tl.program_id(0)
    if row < Q_ROWS:
        _norm_rope_row(q_ptr, q_ptr, cos_ptr, sin_ptr, q_out_ptr, slot_ptr, row, row // HEADS, D, R, eps, 1.0,
                       True, False, False, BLOCK_D, BLOCK_R)
    else:
        _norm_rope_row(kv_ptr, kv_w_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, row - Q_ROWS, row - Q_ROWS, D, R, eps,
                       1.0, True, True, True, BLOCK_D, BLOCK_R)


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, row, t, D, R, eps, sin_sign,
                   NORM: tl.constexpr, HAS_W: tl.constexpr, INSERT: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    scale = 1.0
    if NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * scale
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    dst = row * D
    if INSERT:
        dst = tl.load(slot_ptr + t) * D
    nope = D - R
    tl.store(out_ptr + dst + cols, y.to(out_ptr.dtype.element_ty), mask=cols < nope)
    i = tl.arange(0, BLOCK_R)
    im = i < R // 2
    ev = nope + 2 * i
    xe = tl.load(x_ptr + row * D + ev, mask=im, other=0.0).to(tl.float32) * scale
    xo = tl.load(x_ptr + row * D + ev + 1, mask=im, other=0.0).to(tl.float32) * scale
    if HAS_W:
        xe = xe * tl.load(w_ptr + ev, mask=im, other=0.0).to(tl.float32)
        xo = xo * tl.load(w_ptr + ev + 1, mask=im, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * (R // 2) + i, mask=im, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * (R // 2) + i, mask=im, other=0.0).to(tl.float32) * sin_sign
    tl.store(out_ptr + dst + ev, (xe * c - xo * s).to(out_ptr.dtype.element_ty), mask=im)
    tl.store(out_ptr + dst + ev + 1, (xo * c + xe * s).to(out_ptr.dtype.element_ty), mask=im)


def _launch(x, weight, cos, sin, eps, norm, out, slots=None, sin_sign=1.0):
    D, R = x.shape[-1], 2 * cos.shape[-1]
    heads = x[0].numel() // D if x.dim() > 1 else 1
    rows = x.numel() // D
    _norm_rope_kernel[(rows,)](x, weight if weight is not None else x, cos.contiguous(), sin.contiguous(), out,
                               slots if slots is not None else x, D, R, heads, eps, sin_sign, NORM=norm,
                               HAS_W=weight is not None, INSERT=slots is not None,
                               BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(max(R // 2, 1)),
                               **pdl.options(x))
    return out


def norm_rope_fused(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    eps: float) -> torch.Tensor:
    x = x.contiguous()
    return _launch(x, weight, cos, sin, eps, True, torch.empty_like(x))


def apply_rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return _launch(x, None, cos, sin, 0.0, False, torch.empty_like(x))


def kv_norm_rope_insert_fused(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              eps: float, pool: torch.Tensor, slots: torch.Tensor) -> None:
    _launch(kv.contiguous(), weight, cos, sin, eps, True, pool, slots=slots)


def q_kv_norm_rope_fused(q: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, eps: float, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """norm_rope(q) and kv_norm_rope_insert(kv) in one launch with the fusion switch q_kv_rope (kernels/fusions.py),
    else in two; -> the rotated q."""
    D = q.shape[-1]
    if not fusions.on("q_kv_rope") or kv.shape[-1] != D or q.shape[0] == 0:
        out = norm_rope_fused(q, None, cos, sin, eps)
        kv_norm_rope_insert_fused(kv, kv_weight, cos, sin, eps, pool, slots)
        return out
    q, kv = q.contiguous(), kv.contiguous()
    out = torch.empty_like(q)
    R, q_rows = 2 * cos.shape[-1], q.numel() // D
    _q_kv_norm_rope_kernel[(q_rows + kv.numel() // D,)](
        q, out, kv, kv_weight, pool, slots, cos.contiguous(), sin.contiguous(), D, R, q[0].numel() // D, q_rows, eps,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(max(R // 2, 1)), **pdl.options(q))
    return out
