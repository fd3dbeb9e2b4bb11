"""Fused paged attention for prefill chunks: every key of a query token (its window, then its compressed entries)
in one loop, so the software pipeliner streams the key tiles into shared memory (cp.async) while the tensor cores
work; kernels/fused_attention.py's decode kernel walks three loops (window, entries, selection) and keeps every
key tile in registers first, which at V4's 64 heads x 512 spills (its compile: 255 registers, hundreds of bytes
of stack).

One program per (query token, block of heads, block of output columns): the heads are the MMA's rows (K = V, so
they all read the same keys). Key slot i < n_win is window position lo + i; past it, entry i - n_win (HCA: every
complete entry; CSA: the indexer's pick, valid picks first). Both pools are read through one base pointer: the
compressed pool's rows sit at COMP_OFF elements from the window pool's (two allocations of the same dtype), so a
tile's rows come from either pool in one gather. BLOCK_D < head_dim splits the output columns over programs, each
recomputing the scores (QK is half the FLOPs): its accumulator shrinks with it. Positions and tables in int32,
block size, ratio and entries per block as constants: the index arithmetic is shifts, not 64-bit divisions.
Same result as kernels.reference.paged_attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["wtab_stride", "ftab_stride"])  # table widths vary per eager step
def _prefill_attention_kernel(
    q_ptr, out_ptr, pos_ptr, seq_ptr, win_ptr, wtab_ptr, wtab_stride, replay_ptr, ftab_ptr, ftab_stride, sel_ptr,
    sink_ptr, scale, H, W, COMP_OFF,
    BS: tl.constexpr, RATIO: tl.constexpr, PER_BLOCK: tl.constexpr, HD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr, DOT_F32: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, HD)
    dv = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (t * H + heads)[:, None] * HD + d[None, :], mask=hmask[:, None], other=0.0)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    s = tl.load(seq_ptr + t).to(tl.int32)
    lo = tl.maximum(tl.maximum(pos - W + 1, tl.load(replay_ptr + s).to(tl.int32)), 0)
    n_win = pos + 1 - lo
    if MODE == 0:
        n_all = n_win
    elif MODE == 1:  # HCA: every complete entry, (e + 1) * ratio <= pos + 1
        n_all = n_win + (pos + 1) // RATIO
    else:  # CSA: no more picks than visible entries are valid
        n_all = n_win + tl.minimum((pos + 1) // RATIO, TOPK)
    qk_scale = scale * LOG2E  # exp2 below
    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    for start in range(0, n_all, BLOCK_N):
        i = start + n_off
        in_win = i < n_win
        valid = i < n_all
        p = lo + i
        wblk = tl.load(wtab_ptr + s * wtab_stride + p // BS, mask=in_win, other=0)
        off = (wblk * BS + p % BS).to(tl.int64) * HD
        if MODE != 0:
            c = i - n_win
            cmask = valid & (c >= 0)
            if MODE == 2:
                e = tl.load(sel_ptr + t * TOPK + c, mask=cmask, other=-1)
                valid = valid & (in_win | (e >= 0))
                e = tl.maximum(e, 0)
            else:
                e = c
            cblk = tl.load(ftab_ptr + s * ftab_stride + e // PER_BLOCK, mask=cmask, other=0)
            off = tl.where(in_win, off, COMP_OFF + (cblk * PER_BLOCK + e % PER_BLOCK).to(tl.int64) * HD)
        # rows of 16-byte multiples: the axis analysis loses that through the select, and without it no cp.async
        kp = win_ptr + tl.multiple_of(off, 16)
        k = tl.load(kp[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:  # the interpreter's bf16 dot is wrong: float32 there
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(valid[None, :], sc * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if BLOCK_D == HD:
            v = k
        else:  # this program's columns of the same rows (an L1 / L2 hit)
            v = tl.load(kp[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            acc = tl.dot(pr, v.to(tl.float32), acc * alpha[:, None])
        else:
            acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    m_all = tl.maximum(m_i, sink)
    l_all = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
    o = acc * (tl.exp2(m_i - m_all) / l_all)[:, None]
    tl.store(out_ptr + (t * H + heads)[:, None] * HD + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None])


def comp_offset(window_pool: torch.Tensor, comp_pool: torch.Tensor | None) -> int | None:
    """The compressed pool's first element counted from the window pool's (COMP_OFF), or None where one base
    pointer cannot reach both: other dtypes, or an offset that is not whole 16-byte vectors."""
    if comp_pool is None:
        return 0
    gap = comp_pool.data_ptr() - window_pool.data_ptr()
    size = window_pool.element_size()
    if comp_pool.dtype != window_pool.dtype or gap % 16 or not comp_pool.is_contiguous():
        return None
    return gap // size


def prefill_attention(q, out, positions, token_seq, window_pool, window_tables, replay_starts, sliding_window,
                      comp_off, full_tables, ratio, per_block, selected, sinks, scale, mode: int, tiles: tuple,
                      interpret: bool):
    """Launch over q [T, H, hd] into out; tiles (BLOCK_H, BLOCK_N, num_warps, BLOCK_D (None: hd)[, num_stages])."""
    T, H, hd = q.shape
    block_h, block_n, warps, block_d, *stages = tiles
    block_d = block_d or hd
    bs = window_pool.shape[1]
    topk = selected.shape[1] if selected is not None else 1
    grid = (T, triton.cdiv(H, block_h), hd // block_d)
    _prefill_attention_kernel[grid](
        q, out, positions, token_seq, window_pool, window_tables, window_tables.stride(0), replay_starts,
        full_tables if full_tables is not None else window_tables,
        full_tables.stride(0) if full_tables is not None else 0,
        selected.contiguous() if selected is not None else positions, sinks, scale, H, sliding_window, comp_off,
        BS=bs, RATIO=max(ratio, 1), PER_BLOCK=per_block, HD=hd, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        MODE=mode, TOPK=topk, DOT_F32=interpret, num_warps=warps, num_stages=stages[0] if stages else 3,
    )
    return out
