"""Fused compressor decode step: one program per sequence does what kernels.reference.compress_decode
does in ~40 small torch ops: add the gate's position bias (ape) and store the new token into the open block; when it closes the block,
softmax-pool it (CSA: with the previous block's Ca slice), RMSNorm, RoPE at the block's first
position, write the entry into the paged pool, and keep the Ca slice for the next block (and at a
full-block end for the prefix cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release


@triton.jit
def _norm_rope_entry(dst, sumsq, w_ptr, inv_freq_ptr, pos0, eps, HD: tl.constexpr, R: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """A pooled entry at `dst` (sum of its squares: sumsq): RMSNorm, then RoPE (interleaved pairs,
    the last R features) at position pos0, in place."""
    rs = tl.rsqrt(sumsq / HD + eps)
    NOPE: tl.constexpr = HD - R
    for d0 in range(0, NOPE, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < NOPE
        y = tl.load(dst + d, mask=dm, other=0.0).to(tl.float32) * rs * tl.load(w_ptr + d, mask=dm, other=0.0)
        tl.store(dst + d, y.to(dst.dtype.element_ty), mask=dm)
    j = tl.arange(0, BLOCK_R)
    jm = j < R // 2
    ev = NOPE + 2 * j
    xe = tl.load(dst + ev, mask=jm, other=0.0).to(tl.float32) * rs * tl.load(w_ptr + ev, mask=jm, other=0.0)
    xo = tl.load(dst + ev + 1, mask=jm, other=0.0).to(tl.float32) * rs * tl.load(w_ptr + ev + 1, mask=jm, other=0.0)
    ang = pos0.to(tl.float32) * tl.load(inv_freq_ptr + j, mask=jm, other=0.0)
    c, s = tl.cos(ang), tl.sin(ang)
    tl.store(dst + ev, (xe * c - xo * s).to(dst.dtype.element_ty), mask=jm)
    tl.store(dst + ev + 1, (xo * c + xe * s).to(dst.dtype.element_ty), mask=jm)


@triton.jit
def _pool_store(kv, g, pkv, pg, have, dst, d, dm, sumsq, OVERLAP: tl.constexpr):
    """Softmax-pool one feature slice of a block (rows [BLOCK_M, BLOCK_D]: kv and its gate g; CSA also
    the previous block's Ca rows pkv / pg, weighted 0 while `have` is 0), store it at dst + d in the
    pool's dtype; returns sumsq plus the slice's sum of squares (for the entry's RMSNorm)."""
    mx = tl.max(g, axis=0)
    if OVERLAP:
        pkv = tl.where(have != 0, pkv, 0.0)  # no previous block yet: weight 0
        pg = tl.where(have != 0, pg, -float("inf"))
        mx = tl.maximum(mx, tl.max(pg, axis=0))
    p = tl.exp(g - mx[None, :])
    den = tl.sum(p, axis=0)
    num = tl.sum(p * kv, axis=0)
    if OVERLAP:
        pp = tl.exp(pg - mx[None, :])
        den += tl.sum(pp, axis=0)
        num += tl.sum(pp * pkv, axis=0)
    pooled = num / den
    tl.store(dst + d, pooled.to(dst.dtype.element_ty), mask=dm)
    return sumsq + tl.sum(tl.where(dm, pooled * pooled, 0.0), axis=0)


@triton.jit(do_not_specialize=["ftab_stride"])
def _compress_decode_kernel(
    kv_ptr, kv_stride, gate_ptr, gate_stride, ape_ptr, pos_ptr, slot_ptr, pend_kv_ptr, pend_gate_ptr, prev_kv_ptr,
    prev_gate_ptr, has_prev_ptr, bnd_kv_ptr, bnd_gate_ptr, w_ptr, inv_freq_ptr, pool_ptr, ftab_ptr, ftab_stride, eps,
    BS, PER_BLOCK,
    M: tl.constexpr, HD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr,
    HAS_BND: tl.constexpr, HAS_APE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_and_release(PDL)
    i = tl.program_id(0)
    pos = tl.load(pos_ptr + i)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    off = pos % M
    W: tl.constexpr = C * HD
    # 1. the new token into its slot of the open block
    for d0 in range(0, W, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < W
        tl.store(pend_kv_ptr + (slot * M + off) * W + d, tl.load(kv_ptr + i * kv_stride + d, mask=dm), mask=dm)
        g = tl.load(gate_ptr + i * gate_stride + d, mask=dm)
        if HAS_APE:  # the gate's position bias for its slot in the block, added in fp32 as torch promotes
            g = g.to(tl.float32) + tl.load(ape_ptr + off * W + d, mask=dm)
        tl.store(pend_gate_ptr + (slot * M + off) * W + d, g.to(pend_gate_ptr.dtype.element_ty), mask=dm)
    if off == M - 1:
        tl.debug_barrier()  # the stores above are read back below by other threads of this program
        r = tl.arange(0, BLOCK_M)
        rm = r < M
        have = 0
        if OVERLAP:
            have = tl.load(has_prev_ptr + slot).to(tl.int32)
        e = pos // M
        blk = tl.load(ftab_ptr + i * ftab_stride + e // PER_BLOCK)
        dst = pool_ptr + (blk * PER_BLOCK + e % PER_BLOCK) * HD
        sumsq = 0.0
        # 2. softmax-pool over the block's slots (CSA: Ca of the previous block + Cb of this one), per feature
        for d0 in range(0, HD, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < HD
            base = (slot * M + r[:, None]) * W + (C - 1) * HD + d[None, :]  # CSA: the Cb half; HCA: all
            kv = tl.load(pend_kv_ptr + base, mask=rm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            g = tl.load(pend_gate_ptr + base, mask=rm[:, None] & dm[None, :], other=-float("inf")).to(tl.float32)
            pkv, pg = kv, g  # HCA: not read
            if OVERLAP:
                pbase = (slot * M + r[:, None]) * HD + d[None, :]
                pm = rm[:, None] & dm[None, :]
                pkv = tl.load(prev_kv_ptr + pbase, mask=pm, other=0.0).to(tl.float32)
                pg = tl.load(prev_gate_ptr + pbase, mask=pm, other=-float("inf")).to(tl.float32)
            sumsq = _pool_store(kv, g, pkv, pg, have, dst, d, dm, sumsq, OVERLAP)
        tl.debug_barrier()
        # 3. RMSNorm and RoPE at the block's first position, in place in the pool
        _norm_rope_entry(dst, sumsq, w_ptr, inv_freq_ptr, e * M, eps, HD, R, BLOCK_D, BLOCK_R)
        # 4. CSA: this block's Ca slice is the next block's overlap (and, at a full-block end, cached)
        if OVERLAP:
            at_end = (pos + 1) % BS == 0
            bblk = tl.load(ftab_ptr + i * ftab_stride + pos // BS).to(tl.int64)
            for d0 in range(0, HD, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                m2 = rm[:, None] & (d[None, :] < HD)
                src = (slot * M + r[:, None]) * W + d[None, :]
                ca = tl.load(pend_kv_ptr + src, mask=m2)
                cg = tl.load(pend_gate_ptr + src, mask=m2)
                tl.store(prev_kv_ptr + (slot * M + r[:, None]) * HD + d[None, :], ca, mask=m2)
                tl.store(prev_gate_ptr + (slot * M + r[:, None]) * HD + d[None, :], cg, mask=m2)
                if HAS_BND:
                    if at_end:
                        tl.store(bnd_kv_ptr + (bblk * M + r[:, None]) * HD + d[None, :], ca, mask=m2)
                        tl.store(bnd_gate_ptr + (bblk * M + r[:, None]) * HD + d[None, :], cg, mask=m2)
            tl.store(has_prev_ptr + slot, 1)


def rows_unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t [rows, W] as the kernels read it: any row stride (a column slice of engine/models/stacked_linears.py's
    one output), unit stride along a row."""
    return t if t.stride(-1) == 1 else t.contiguous()


def compress_decode_fused(kv, gate, positions, slots, pend_kv, pend_gate, prev_kv, prev_gate, has_prev, bnd_kv,
                          bnd_gate, norm_w, eps, inv_freq, pool, full_tables, block_size, ratio, head_dim, ape=None):
    S = positions.shape[0]
    overlap = prev_kv is not None
    C = 2 if overlap else 1
    R = 2 * inv_freq.shape[0]
    kv = rows_unit_stride(kv.to(pend_kv.dtype))  # rows may be a column slice of a stacked GEMM's output
    gate = rows_unit_stride(gate if ape is not None else gate.to(pend_gate.dtype))  # ape: the kernel adds and casts
    dummy = pend_gate
    hp = has_prev.view(torch.uint8) if overlap else dummy
    _compress_decode_kernel[(S,)](
        kv, kv.stride(0), gate, gate.stride(0), ape.float().contiguous() if ape is not None else dummy, positions, slots, pend_kv, pend_gate,
        prev_kv if overlap else dummy,
        prev_gate if overlap else dummy, hp, bnd_kv if bnd_kv is not None else dummy,
        bnd_gate if bnd_gate is not None else dummy, norm_w.float().contiguous(), inv_freq.float().contiguous(),
        pool, full_tables, full_tables.stride(0), eps, block_size, pool.shape[1],
        M=ratio, HD=head_dim, C=C, R=R, OVERLAP=overlap, HAS_BND=bnd_kv is not None, HAS_APE=ape is not None,
        BLOCK_M=triton.next_power_of_2(ratio), BLOCK_D=min(triton.next_power_of_2(head_dim), max(16, 4096 // ratio)),
        BLOCK_R=triton.next_power_of_2(max(R // 2, 1)), **pdl.options(kv))
