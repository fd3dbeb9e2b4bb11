"""Fused paged attention for DeepSeek-V4: sliding window + compressed entries + sinks, one pass.

One program per (query token, block of heads). K = V (shared-KV MQA), so every head of a
token reads the same keys: heads form the M side of the matmuls (as FlashMLA does for
decode). Keys stream in blocks from the paged window pool (positions (i - W, i], none below
the sequence's replay_start), then from the compressed pool: every complete entry (HCA) or
the indexer's selection (CSA; read only up to the visible count, since indexer_topk puts
its valid picks before the -1 padding). Online softmax; the sink joins the denominator at the end.
Same signature as kernels.reference.paged_attention. Prefill chunks (PREFILL_T tokens or more) run
kernels/fused_attention_prefill.py instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_attention_prefill import comp_offset, prefill_attention

# Triton's CPU interpreter computes bf16 tl.dot wrongly (seen with Triton 3.9: errors of 1e10),
# so under TRITON_INTERPRET the dots run in fp32; on the GPU they stay in the model dtype.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _update(q, k, valid, m_i, l_i, acc, scale, DOT_F32: tl.constexpr):
    if DOT_F32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["wtab_stride", "ftab_stride"])  # table widths vary per eager step
def _paged_attention_kernel(
    q_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, seq_ptr, win_ptr, wtab_ptr, wtab_stride,
    replay_ptr, comp_ptr, ftab_ptr, ftab_stride, sel_ptr, sink_ptr, scale, H, W, BS, RATIO, PER_BLOCK,
    HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr,
    NSPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Split j of NSPLIT takes the j-th slice of the window, of the entries and of the selection
    (flash-decoding: enough programs for one token); NSPLIT > 1 writes partials to combine."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.program_id(2)
    hmask = heads < H
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * H + heads)[:, None] * HD + d[None, :], mask=hmask[:, None], other=0.0)
    pos = tl.load(pos_ptr + t)
    s = tl.load(seq_ptr + t)
    lo = tl.maximum(tl.maximum(pos - W + 1, tl.load(replay_ptr + s)), 0)
    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HD), tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    cw = tl.cdiv(pos + 1 - lo, NSPLIT)
    w_lo = lo + j * cw
    w_hi = tl.minimum(w_lo + cw, pos + 1)
    for start in range(w_lo, w_hi, BLOCK_N):  # the window, from the paged window pool
        p = start + n_off
        valid = p < w_hi
        blk = tl.load(wtab_ptr + s * wtab_stride + p // BS, mask=valid, other=0)
        k = tl.load(win_ptr + (blk * BS + p % BS)[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _update(q, k, valid, m_i, l_i, acc, scale, DOT_F32)
    if MODE == 1:  # HCA: every complete entry (e + 1) * ratio <= pos + 1
        n_vis = (pos + 1) // RATIO
        ce = tl.cdiv(n_vis, NSPLIT)
        e_hi = tl.minimum((j + 1) * ce, n_vis)
        for start in range(j * ce, e_hi, BLOCK_N):
            e = start + n_off
            valid = e < e_hi
            blk = tl.load(ftab_ptr + s * ftab_stride + e // PER_BLOCK, mask=valid, other=0)
            k = tl.load(comp_ptr + (blk * PER_BLOCK + e % PER_BLOCK)[:, None] * HD + d[None, :],
                        mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _update(q, k, valid, m_i, l_i, acc, scale, DOT_F32)
    if MODE == 2:  # CSA: the indexer's top-k, its valid picks first, then -1 padding
        n_sel = tl.minimum((pos + 1) // RATIO, TOPK)  # no more than the visible entries are valid
        cs = tl.cdiv(n_sel, NSPLIT)
        s_hi = tl.minimum((j + 1) * cs, n_sel)
        for start in range(j * cs, s_hi, BLOCK_N):
            i = start + n_off
            e = tl.load(sel_ptr + t * TOPK + i, mask=i < s_hi, other=-1)
            valid = e >= 0
            e = tl.where(valid, e, 0)
            blk = tl.load(ftab_ptr + s * ftab_stride + e // PER_BLOCK, mask=valid, other=0)
            k = tl.load(comp_ptr + (blk * PER_BLOCK + e % PER_BLOCK)[:, None] * HD + d[None, :],
                        mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _update(q, k, valid, m_i, l_i, acc, scale, DOT_F32)
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        m_all = tl.maximum(m_i, sink)
        l_all = l_i * tl.exp(m_i - m_all) + tl.exp(sink - m_all)
        o = acc * (tl.exp(m_i - m_all) / l_all)[:, None]
        tl.store(out_ptr + (t * H + heads)[:, None] * HD + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None])
    else:
        row = (t * H + heads) * NSPLIT + j
        tl.store(part_m_ptr + row, m_i, mask=hmask)
        tl.store(part_l_ptr + row, l_i, mask=hmask)
        tl.store(part_acc_ptr + row[:, None] * HD + d[None, :], acc, mask=hmask[:, None])


@triton.jit
def _combine_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, H,
                    HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr):
    """Program (token, heads, columns): its own small slice, so the partials of one decode token are read by many
    programs at once (one program per 16 heads read 512 KB each for V4's 64 x 512 at 16 splits)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    sp = tl.arange(0, NSPLIT)
    rows = (t * H + heads)[:, None] * NSPLIT + sp[None, :]
    m = tl.load(part_m_ptr + rows, mask=hmask[:, None], other=-float("inf"))
    l = tl.load(part_l_ptr + rows, mask=hmask[:, None], other=0.0)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    m_all = tl.maximum(tl.max(m, axis=1), sink)
    w = tl.exp(m - m_all[:, None])
    l_all = tl.sum(l * w, axis=1) + tl.exp(sink - m_all)
    o = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for i in tl.static_range(NSPLIT):
        wi = tl.sum(tl.where(sp[None, :] == i, w, 0.0), axis=1)
        a = tl.load(part_acc_ptr + ((t * H + heads) * NSPLIT + i)[:, None] * HD + d[None, :], mask=hmask[:, None],
                    other=0.0)
        o += a * wi[:, None]
    o = o / l_all[:, None]
    tl.store(out_ptr + (t * H + heads)[:, None] * HD + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None])


# Prefill chunks of PREFILL_T tokens or more run kernels/fused_attention_prefill.py (one pipelined loop over every
# key of a token); its tiles per branch (MODE: 0 window only, 1 HCA, 2 CSA) for V4's 64 heads x 512, else
# PREFILL_TILES_SMALL: (BLOCK_H, BLOCK_N, num_warps, BLOCK_D); BLOCK_D None: the whole head_dim
PREFILL_T = 256
COMBINE_BLOCK_H, COMBINE_BLOCK_D = 8, 128  # the split-K combine's slice per program
PREFILL_TILES = {0: (64, 64, 8, 512, 2), 1: (64, 64, 8, 512, 2), 2: (64, 64, 8, 512, 2)}
PREFILL_TILES_SMALL = (16, 32, 4, None)


def _prefill_tiles(mode: int, H: int, hd: int) -> tuple:
    if H >= 64 and hd == 512:
        return PREFILL_TILES[mode]
    bh, bn, warps, _ = PREFILL_TILES_SMALL
    return max(bh, min(64, triton.next_power_of_2(H))), bn, warps, hd


def paged_attention_fused(q, positions, token_seq, window_pool, window_tables, replay_starts, sliding_window,
                          comp_pool, full_tables, ratio, selected, sinks, scale, nsplit: int | None = None,
                          block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                          prefill_tiles: tuple | None = None):
    """nsplit, block_h, block_n, num_warps: the decode kernel's tiles; prefill_tiles: the prefill kernel's (either
    kind asked for by its tiles: tools/bench_attention_prefill.py sweeps them); None: the defaults below."""
    T, H, hd = q.shape
    assert hd & (hd - 1) == 0, "head_dim must be a power of two for the fused attention kernel"
    q = q.contiguous()
    out = torch.empty_like(q)
    mode = 0 if comp_pool is None else (2 if selected is not None else 1)
    topk = selected.shape[1] if selected is not None else 1
    # every head of a token reads the same keys: more heads per program read them fewer times
    # (prefill, big decode batches); a few tokens need the smaller blocks for parallelism
    BLOCK_H = block_h or (32 if T >= 32 and H >= 32 else 16)
    BLOCK_N = block_n or (32 if hd <= 128 else 16)
    warps = num_warps or (4 if hd <= 128 else 8)
    decode_asked = nsplit is not None or block_h or block_n or num_warps
    if prefill_tiles or (T >= PREFILL_T and not decode_asked):
        comp_off = comp_offset(window_pool, comp_pool)
        if comp_off is not None:
            return prefill_attention(q, out, positions, token_seq, window_pool, window_tables, replay_starts,
                                     sliding_window, comp_off, full_tables, ratio,
                                     comp_pool.shape[1] if comp_pool is not None else 1, selected,
                                     sinks.float().contiguous(), scale, mode,
                                     prefill_tiles or _prefill_tiles(mode, H, hd), _INTERPRET)
    head_blocks = triton.cdiv(H, BLOCK_H)
    if nsplit is None:  # enough programs for ~2 waves on a 132-SM GPU when few tokens decode
        nsplit = 1
        while nsplit < 16 and T * head_blocks * nsplit < 256:
            nsplit *= 2
    if nsplit > 1:
        part_m = torch.empty(T, H, nsplit, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(T, H, nsplit, hd, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = sinks
    _paged_attention_kernel[(T, head_blocks, nsplit)](
        q, out, part_m, part_l, part_acc, positions, token_seq, window_pool, window_tables, window_tables.stride(0),
        replay_starts, comp_pool if comp_pool is not None else window_pool,
        full_tables if full_tables is not None else window_tables,
        full_tables.stride(0) if full_tables is not None else 0,
        selected.contiguous() if selected is not None else positions,
        sinks.float().contiguous(), scale, H, sliding_window, window_pool.shape[1], max(ratio, 1),
        comp_pool.shape[1] if comp_pool is not None else 1,
        HD=hd, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, MODE=mode, TOPK=topk, NSPLIT=nsplit, DOT_F32=_INTERPRET,
        num_warps=warps,
    )
    if nsplit > 1:
        cb_h, cb_d = min(COMBINE_BLOCK_H, BLOCK_H), min(COMBINE_BLOCK_D, hd)
        _combine_kernel[(T, triton.cdiv(H, cb_h), hd // cb_d)](out, part_m, part_l, part_acc, sinks.float().contiguous(),
                                                               H, HD=hd, BLOCK_H=cb_h, BLOCK_D=cb_d, NSPLIT=nsplit)
    return out
