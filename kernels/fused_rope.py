"""Fused RMSNorm + interleaved RoPE (q per head, kv with the window-cache insert) and plain RoPE.

One program per (token, head) row: the norm's sum of squares over the whole row, then the
nope slice scaled and the rope slice rotated pairwise (2i, 2i+1), in fp32, cast once. With the kernel variant
rope_tiles (kernels/variants.py) a program takes ROWS consecutive rows instead (tile_rows), loads them once and
stores them once, coalesced, the pairs split and joined in registers: the same arithmetic per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fusions, pdl, quant_configs, variants
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
    if _tiles(D, R) and rows:
        block_rows = tile_rows(rows)
        _norm_rope_tile_kernel[(triton.cdiv(rows, block_rows),)](
            x, weight if weight is not None else x, cos.contiguous(), sin.contiguous(), out,
            slots if slots is not None else x, rows, D, R, heads, eps, sin_sign, NORM=norm, HAS_W=weight is not None,
            INSERT=slots is not None, ROWS=block_rows, BLOCK_D=triton.next_power_of_2(D),
            num_warps=_tile_warps(block_rows, D), **pdl.options(x))
        return out
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
    if _tiles(D, R):
        block_rows = tile_rows(q_rows)  # the query's rows decide: 64 a token against the latent's one
        q_progs, kv_rows = triton.cdiv(q_rows, block_rows), kv.numel() // D
        _q_kv_norm_rope_tile_kernel[(q_progs + triton.cdiv(kv_rows, block_rows),)](
            q, out, kv, kv_weight, pool, slots, cos.contiguous(), sin.contiguous(), q_rows, kv_rows, q_progs, D, R,
            q[0].numel() // D, eps, ROWS=block_rows, BLOCK_D=triton.next_power_of_2(D),
            num_warps=_tile_warps(block_rows, D), **pdl.options(q))
        return out
    _q_kv_norm_rope_kernel[(q_rows + kv.numel() // D,)](
        q, out, kv, kv_weight, pool, slots, cos.contiguous(), sin.contiguous(), D, R, q[0].numel() // D, q_rows, eps,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(max(R // 2, 1)), **pdl.options(q))
    return out


# --- the rope_tiles variant: [ROWS, D] per program ---------------------------------------------

# rows a program takes: ROPE_TILE_ROWS at prefill's many rows, halved while there are fewer than ROPE_TILE_PROGRAMS
# programs, down to ROPE_TILE_MIN_ROWS (powers of two). From the rows sweep of suite prefill_small_ops (64 query
# heads of 512): 2 rows fastest at 1-150 tokens (5.6 us at 150 against 7.7 for one row), 8 at 2048-8192 (16 and 32
# slower); 1 row is no faster anywhere
ROPE_TILE_ROWS = 8
ROPE_TILE_MIN_ROWS = 2
ROPE_TILE_PROGRAMS = 32 * quant_configs.SMS
ROPE_TILE_WARPS = (4, 8)  # warps of a tile up to 4096 elements, and past it


def tile_rows(rows: int) -> int:
    """Rows per program: ROPE_TILE_ROWS, halved while that leaves fewer than ROPE_TILE_PROGRAMS programs, not below
    ROPE_TILE_MIN_ROWS (decode's 64 query rows: two a program)."""
    r = ROPE_TILE_ROWS
    while r > ROPE_TILE_MIN_ROWS and triton.cdiv(rows, r) < ROPE_TILE_PROGRAMS:
        r //= 2
    return r


def _tile_warps(block_rows: int, D: int) -> int:
    return ROPE_TILE_WARPS[block_rows * triton.next_power_of_2(D) > 4096]


def _tiles(D: int, R: int) -> bool:
    """The variant is on and the rope pairs (2i, 2i+1) of the whole row are the rope slice's pairs (an even nope)."""
    return variants.on("rope_tiles") and (D - R) % 2 == 0


@triton.jit(do_not_specialize=["n_rows"])
def _norm_rope_tile_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, n_rows, D, R, HEADS, eps, sin_sign,
                           NORM: tl.constexpr, HAS_W: tl.constexpr, INSERT: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait_and_release(PDL)
    _norm_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, tl.program_id(0) * ROWS, n_rows, D, R, HEADS,
                    eps, sin_sign, NORM, HAS_W, INSERT, ROWS, BLOCK_D)


@triton.jit(do_not_specialize=["Q_ROWS", "KV_ROWS", "Q_PROGS"])
def _q_kv_norm_rope_tile_kernel(q_ptr, q_out_ptr, kv_ptr, kv_w_ptr, pool_ptr, slot_ptr, cos_ptr, sin_ptr, Q_ROWS,
                                KV_ROWS, Q_PROGS, D, R, HEADS, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                                PDL: tl.constexpr = False):
    """_q_kv_norm_rope_kernel in tiles: the first Q_PROGS programs the query heads, the rest the K=V latent."""
    wait_and_release(PDL)
    pid = tl.program_id(0)
    if pid < Q_PROGS:
        _norm_rope_tile(q_ptr, q_ptr, cos_ptr, sin_ptr, q_out_ptr, slot_ptr, pid * ROWS, Q_ROWS, D, R, HEADS, eps,
                        1.0, True, False, False, ROWS, BLOCK_D)
    else:
        _norm_rope_tile(kv_ptr, kv_w_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, (pid - Q_PROGS) * ROWS, KV_ROWS, D, R,
                        1, eps, 1.0, True, True, True, ROWS, BLOCK_D)


@triton.jit
def _norm_rope_tile(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slot_ptr, row0, n_rows, D, R, HEADS, eps, sin_sign,
                    NORM: tl.constexpr, HAS_W: tl.constexpr, INSERT: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Rows row0 .. row0 + ROWS (those below n_rows; row // HEADS its token): _norm_rope_row's arithmetic on each
    element, the whole tile loaded once; pair p holds columns (2p, 2p + 1), and the pairs from (D - R) / 2 on
    are rotated by the token's cos / sin entry p - (D - R) / 2."""
    HALF: tl.constexpr = BLOCK_D // 2
    rows = row0 + tl.arange(0, ROWS)
    rm = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    m = rm[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = x
    if NORM:
        y = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    ye, yo = tl.split(tl.reshape(y, (ROWS, HALF, 2)))
    p = tl.arange(0, HALF)
    first = (D - R) // 2
    rope = rm[:, None] & ((p >= first) & (p < D // 2))[None, :]
    cs = (rows // HEADS)[:, None] * (R // 2) + (p - first)[None, :]
    c = tl.load(cos_ptr + cs, mask=rope, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=rope, other=0.0).to(tl.float32) * sin_sign
    ye, yo = tl.where(rope, ye * c - yo * s, ye), tl.where(rope, yo * c + ye * s, yo)
    y = tl.reshape(tl.join(ye, yo), (ROWS, BLOCK_D))
    dst = rows.to(tl.int64)
    if INSERT:
        dst = tl.load(slot_ptr + rows, mask=rm, other=0).to(tl.int64)
    tl.store(out_ptr + dst[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
