"""Fused compressor multi-row step (prefill chunks, mixed steps, speculative verify): what
kernels.reference.compress_blocks does in 45-70 small torch ops per compressor, in three launches
(two without CSA overlap) over the plan's padded arrays (engine/compress_plan.py):

1. one program per closed block: its rows straight from this step's kv/gate or the open block
   (plan.src picks; no concatenation), CSA's overlap with the previous block's Ca slice (the state's
   or this step's block j - 1, from either source), softmax-pool, RMSNorm, RoPE at the block's first
   position, the entry into the paged pool; the block's rows to `closed` (speculative rollback) and,
   at a full-block end, its Ca slice to the prefix-cache boundary state.
2. CSA: one program per sequence that closed a block: its last Ca slice becomes the overlap state.
3. one program per row left open: into pend_*.

This step's gate rows get their position bias (ape) where they are read, as the decode kernel does.
The launches are separate because each reads state the next one overwrites (1 reads prev_* and
pend_*, 2 reads pend_* rows a closed block took from the open block, 3 writes pend_*). The
arithmetic is _compress_decode_kernel's (fp32 softmax and sums, the pooled entry rounded to the pool
dtype before the norm), so a block closed here and one closed by a decode step agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_compress import _norm_rope_entry, _pool_store, rows_unit_stride


@triton.jit
def _rows(step_ptr, step_stride, pend_ptr, src, T, col, mask, W: tl.constexpr, other):
    """Rows `src` [BLOCK_M] at columns `col` [BLOCK_D]: src < T from this step's rows (row stride
    step_stride: they may be a column slice of a stacked GEMM's output), else row src - T of the open
    blocks (pend_*, [slots * ratio, W])."""
    step = src < T
    a = tl.load(step_ptr + src[:, None] * step_stride + col[None, :], mask=mask & step[:, None], other=other)
    b = tl.load(pend_ptr + (src - T)[:, None] * W + col[None, :], mask=mask & (~step)[:, None], other=other)
    return tl.where(step[:, None], a, b)


# the plan's arrays are views at step-dependent offsets of one buffer (engine/compress_plan.py): no
# specializing on their alignment, which would compile new variants inside some request's step
@triton.jit
def _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, src, T, r, col, mask, W: tl.constexpr, other,
               HAS_APE: tl.constexpr):
    """_rows of the gate in the open blocks' dtype; this step's rows get their position bias here when
    HAS_APE (ape [ratio, W]: a block's row r sits at position % ratio == r)."""
    step = src < T
    a = tl.load(gate_ptr + src[:, None] * gate_stride + col[None, :], mask=mask & step[:, None], other=other)
    a = a.to(pend_gate_ptr.dtype.element_ty)
    if HAS_APE:
        a += tl.load(ape_ptr + r[:, None] * W + col[None, :], mask=mask & step[:, None], other=0.0).to(a.dtype)
    b = tl.load(pend_gate_ptr + (src - T)[:, None] * W + col[None, :], mask=mask & (~step)[:, None], other=other)
    return tl.where(step[:, None], a, b)


@triton.jit(do_not_specialize=["T", "NS", "ftab_stride"],
            do_not_specialize_on_alignment=["src_ptr", "blk_seq_ptr", "blk_entry_ptr", "prev_ptr", "ftab_ptr"])
def _compress_blocks_kernel(
    kv_ptr, kv_stride, gate_ptr, gate_stride, pend_kv_ptr, pend_gate_ptr, prev_kv_ptr, prev_gate_ptr, has_prev_ptr,
    bnd_kv_ptr, bnd_gate_ptr, src_ptr, blk_seq_ptr, blk_entry_ptr, prev_ptr, w_ptr, inv_freq_ptr, pool_ptr, ftab_ptr, ckv_ptr, cgate_ptr,
    ape_ptr, T, NS, ftab_stride, eps, BS, PER_BLOCK,
    M: tl.constexpr, HD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr,
    HAS_BND: tl.constexpr, KEEP: tl.constexpr, HAS_APE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = C * HD
    r = tl.arange(0, BLOCK_M)
    rm = r < M
    src = tl.load(src_ptr + j * M + r, mask=rm, other=0)
    e = tl.load(blk_entry_ptr + j)
    seq = tl.load(blk_seq_ptr + j)
    blk = tl.load(ftab_ptr + seq * ftab_stride + e // PER_BLOCK).to(tl.int64)
    dst = pool_ptr + (blk * PER_BLOCK + e % PER_BLOCK) * HD
    have = 0
    if OVERLAP:
        pv = tl.load(prev_ptr + j)
        from_state = pv < NS  # the sequence's first closed block: the state's slice (if it has one)
        st_r = ((r * 0 + pv) < NS)[:, None]  # the same per row (the interpreter masks by vectors only)
        pslot = tl.where(from_state, pv, 0)
        have = tl.where(from_state, tl.load(has_prev_ptr + pslot).to(tl.int32), 1)
        psrc = tl.load(src_ptr + tl.where(from_state, 0, pv - NS) * M + r, mask=rm, other=0)  # block j - 1's rows
    sumsq = 0.0
    # 1. softmax-pool over the block's rows (CSA: Ca of the previous block + Cb of this one), per feature
    for d0 in range(0, HD, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < HD
        m2 = rm[:, None] & dm[None, :]
        col = (C - 1) * HD + d  # CSA: Cb; HCA: all
        kv = _rows(kv_ptr, kv_stride, pend_kv_ptr, src, T, col, m2, W, 0.0).to(tl.float32)
        g = _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, src, T, r, col, m2, W, -float("inf"),
                       HAS_APE).to(tl.float32)
        pkv, pg = kv, g  # HCA: not read
        if OVERLAP:
            ps = (pslot * M + r[:, None]) * HD + d[None, :]
            skv = tl.load(prev_kv_ptr + ps, mask=m2 & st_r, other=0.0).to(tl.float32)
            sg = tl.load(prev_gate_ptr + ps, mask=m2 & st_r, other=-float("inf")).to(tl.float32)
            bkv = _rows(kv_ptr, kv_stride, pend_kv_ptr, psrc, T, d, m2 & ~st_r, W, 0.0).to(tl.float32)
            bg = _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, psrc, T, r, d, m2 & ~st_r, W,
                            -float("inf"), HAS_APE).to(tl.float32)
            pkv = tl.where(st_r, skv, bkv)
            pg = tl.where(st_r, sg, bg)
        sumsq = _pool_store(kv, g, pkv, pg, have, dst, d, dm, sumsq, OVERLAP)
    tl.debug_barrier()  # the pooled entry is read back below by other threads of this program
    # 2. RMSNorm and RoPE at the block's first position, in place in the pool
    _norm_rope_entry(dst, sumsq, w_ptr, inv_freq_ptr, e * M, eps, HD, R, BLOCK_D, BLOCK_R)
    # 3. the block's rows for a speculative rollback; CSA at a full-block end: its Ca slice, cached
    if KEEP:
        for d0 in range(0, W, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m2 = rm[:, None] & (d[None, :] < W)
            o = (j * M + r[:, None]) * W + d[None, :]
            tl.store(ckv_ptr + o, _rows(kv_ptr, kv_stride, pend_kv_ptr, src, T, d, m2, W, 0.0), mask=m2)
            g = _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, src, T, r, d, m2, W, 0.0, HAS_APE)
            tl.store(cgate_ptr + o, g, mask=m2)
    if HAS_BND:
        if ((e + 1) * M) % BS == 0:
            bblk = tl.load(ftab_ptr + seq * ftab_stride + ((e + 1) * M) // BS - 1).to(tl.int64)
            for d0 in range(0, HD, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                m2 = rm[:, None] & (d[None, :] < HD)
                o = (bblk * M + r[:, None]) * HD + d[None, :]
                tl.store(bnd_kv_ptr + o, _rows(kv_ptr, kv_stride, pend_kv_ptr, src, T, d, m2, W, 0.0), mask=m2)
                g = _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, src, T, r, d, m2, W, 0.0, HAS_APE)
                tl.store(bnd_gate_ptr + o, g, mask=m2)


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["src_ptr", "upd_slot_ptr", "upd_blk_ptr"])
def _compress_overlap_state_kernel(
    kv_ptr, kv_stride, gate_ptr, gate_stride, pend_kv_ptr, pend_gate_ptr, prev_kv_ptr, prev_gate_ptr, has_prev_ptr,
    src_ptr, upd_slot_ptr, upd_blk_ptr, ape_ptr, T, M: tl.constexpr, HD: tl.constexpr, HAS_APE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    k = tl.program_id(0)
    W: tl.constexpr = 2 * HD
    slot = tl.load(upd_slot_ptr + k).to(tl.int64)
    j = tl.load(upd_blk_ptr + k)
    r = tl.arange(0, BLOCK_M)
    rm = r < M
    src = tl.load(src_ptr + j * M + r, mask=rm, other=0)
    for d0 in range(0, HD, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = rm[:, None] & (d[None, :] < HD)
        o = (slot * M + r[:, None]) * HD + d[None, :]
        tl.store(prev_kv_ptr + o, _rows(kv_ptr, kv_stride, pend_kv_ptr, src, T, d, m2, W, 0.0), mask=m2)
        g = _gate_rows(gate_ptr, gate_stride, pend_gate_ptr, ape_ptr, src, T, r, d, m2, W, 0.0, HAS_APE)
        tl.store(prev_gate_ptr + o, g, mask=m2)
    tl.store(has_prev_ptr + slot, 1)


@triton.jit(do_not_specialize_on_alignment=["row_ptr", "dst_ptr"])
def _compress_pend_kernel(kv_ptr, kv_stride, gate_ptr, gate_stride, pend_kv_ptr, pend_gate_ptr, row_ptr, dst_ptr,
                          ape_ptr, M: tl.constexpr, W: tl.constexpr, HAS_APE: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(row_ptr + p).to(tl.int64)
    dst = tl.load(dst_ptr + p).to(tl.int64)
    for d0 in range(0, W, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < W
        kv = tl.load(kv_ptr + row * kv_stride + d, mask=dm)
        tl.store(pend_kv_ptr + dst * W + d, kv.to(pend_kv_ptr.dtype.element_ty), mask=dm)
        g = tl.load(gate_ptr + row * gate_stride + d, mask=dm).to(pend_gate_ptr.dtype.element_ty)
        if HAS_APE:  # its place in the open block is its position % ratio
            g += tl.load(ape_ptr + (dst % M) * W + d, mask=dm).to(g.dtype)
        tl.store(pend_gate_ptr + dst * W + d, g, mask=dm)


def compress_blocks_fused(kv, gate, plan, state, norm_w, eps, inv_freq, pool, full_tables, head_dim,
                          keep_closed=False, positions=None, ape=None):
    st, m, hd = state, plan.ratio, head_dim
    overlap = st.prev_kv is not None
    C = 2 if overlap else 1
    W, R = C * hd, 2 * inv_freq.shape[0]
    T = kv.shape[0]
    kv = rows_unit_stride(kv.to(st.pend_kv.dtype))  # any row stride: a stacked GEMM's column slice reads in place
    gate = rows_unit_stride(gate)  # the kernels cast it to the open blocks' dtype (and add ape there)
    has_ape = ape is not None
    ape = ape.contiguous() if has_ape else st.pend_gate
    NB = plan.blk_seq.shape[0]
    block_m = triton.next_power_of_2(m)
    block_d = min(triton.next_power_of_2(hd), max(16, 4096 // m))
    closed = None
    if plan.num_blocks:
        if keep_closed:
            closed = (st.pend_kv.new_empty(NB, m, W), st.pend_gate.new_empty(NB, m, W))
        dummy = st.pend_gate
        has_bnd = overlap and st.bnd_kv is not None
        _compress_blocks_kernel[(NB,)](
            kv, kv.stride(0), gate, gate.stride(0), st.pend_kv, st.pend_gate, st.prev_kv if overlap else dummy,
            st.prev_gate if overlap else dummy,
            st.has_prev.view(torch.uint8) if overlap else dummy, st.bnd_kv if has_bnd else dummy,
            st.bnd_gate if has_bnd else dummy, plan.src, plan.blk_seq, plan.blk_entry, plan.prev,
            norm_w.float().contiguous(), inv_freq.float().contiguous(), pool, full_tables,
            closed[0] if closed else dummy, closed[1] if closed else dummy, ape,
            T, st.pend_kv.shape[0], full_tables.stride(0), eps, pool.shape[1] * m, pool.shape[1],
            M=m, HD=hd, C=C, R=R, OVERLAP=overlap, HAS_BND=has_bnd, KEEP=closed is not None, HAS_APE=has_ape,
            BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_R=triton.next_power_of_2(max(R // 2, 1)))
        if overlap and plan.upd_slot.shape[0]:
            _compress_overlap_state_kernel[(plan.upd_slot.shape[0],)](
                kv, kv.stride(0), gate, gate.stride(0), st.pend_kv, st.pend_gate, st.prev_kv, st.prev_gate,
                st.has_prev.view(torch.uint8), plan.src, plan.upd_slot, plan.upd_blk, ape, T, M=m, HD=hd, HAS_APE=has_ape, BLOCK_M=block_m, BLOCK_D=block_d)
    if plan.pend_row.shape[0]:
        _compress_pend_kernel[(plan.pend_row.shape[0],)](kv, kv.stride(0), gate, gate.stride(0), st.pend_kv,
                                                        st.pend_gate, plan.pend_row, plan.pend_dst, ape, M=m, W=W, HAS_APE=has_ape,
                                                        BLOCK_D=min(triton.next_power_of_2(W), 1024))
    return closed
