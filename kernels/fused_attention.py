"""Fused paged attention for DeepSeek-V4: sliding window + compressed entries + sinks, one pass.

One program per (query token, block of heads, block of output columns, split). K = V (shared-KV MQA), so every head
of a token reads the same keys: heads form the M side of the matmuls (as FlashMLA does). A token's keys are one
sequence of slots walked by one loop, so the software pipeliner streams the key tiles into shared memory (cp.async)
while the tensor cores work: slot i < n_win is window position lo + i (positions (pos - W, pos], none below the
sequence's replay_start, from the paged window pool), past it entry i - n_win of the compressed pool: every complete
entry (HCA) or the indexer's pick (CSA; its valid picks come first, then -1 padding). Both pools are read through one
base pointer: the compressed pool's rows sit COMP_OFF elements from the window pool's, so one gather serves both.
Online softmax in base 2; the sink joins the denominator at the end.

Splits (flash-decoding: enough programs for a few decode tokens) each take a slice of the slots and write partials
that _combine_kernel joins (fusion switch combine_last: the last split of each token's head block to finish joins
them). BLOCK_D < head_dim splits the output columns over programs, each recomputing the scores (QK is half the
FLOPs): its accumulator shrinks with it. Positions and tables in int32, block size, ratio and entries per block as
constants: the index arithmetic is shifts, not 64-bit divisions.

Same result as kernels.reference.paged_attention. (q's norm + RoPE and the output's inverse RoPE folded into this
kernel measured slower than their own kernels: tools/bench_attention_prefill.py,
docs/perf/h200-2026-12-03-s11/attention_folds.log.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import fusions, pdl, quant_configs, variants
from kernels.fused_rope import apply_rope_fused
from kernels.pdl import wait_and_release
from kernels.semaphores import semaphores

# Triton's CPU interpreter computes bf16 tl.dot wrongly (seen with Triton 3.9: errors of 1e10),
# so under TRITON_INTERPRET the dots run in fp32; on the GPU they stay in the model dtype.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = tl.constexpr(1.4426950408889634)
# a slot without a key in _slot_offsets' table: odd, where every key row's offset is even (rows of a power-of-two
# head_dim >= 16 elements, the compressed pool whole 16-byte vectors away, before or after the window pool)
NO_KEY = tl.constexpr(1)


@triton.jit
def _store_out(out_ptr, o, t, heads, hmask, col0, cos_ptr, sin_ptr, H, HD: tl.constexpr, R: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """out[t, heads, col0 + (0..BLOCK_D)] = o; R > 0: then the (inverse) RoPE of the value's last R columns
    (interleaved pairs) that this tile holds, read back from the stored row after a block barrier (its
    writes visible to the whole program) with token t's cos / sin rows (R / 2 each): kernels.fused_rope's
    arithmetic on the same stored values, the separate rotation launch folded in."""
    rows = (t * H + heads)[:, None] * HD
    tl.store(out_ptr + rows + col0 + tl.arange(0, BLOCK_D)[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None])
    if R > 0:
        if col0 + BLOCK_D > HD - R:
            tl.debug_barrier()
            i = tl.arange(0, R // 2)
            ev = HD - R + 2 * i
            pm = (ev >= col0) & (ev < col0 + BLOCK_D)
            m2 = hmask[:, None] & pm[None, :]
            xe = tl.load(out_ptr + rows + ev[None, :], mask=m2, other=0.0, volatile=True).to(tl.float32)
            xo = tl.load(out_ptr + rows + ev[None, :] + 1, mask=m2, other=0.0, volatile=True).to(tl.float32)
            c = tl.load(cos_ptr + t * (R // 2) + i, mask=pm, other=1.0).to(tl.float32)[None, :]
            sn = tl.load(sin_ptr + t * (R // 2) + i, mask=pm, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows + ev[None, :], (xe * c - xo * sn).to(out_ptr.dtype.element_ty), mask=m2)
            tl.store(out_ptr + rows + ev[None, :] + 1, (xo * c + xe * sn).to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _token_slots(pos_ptr, seq_ptr, replay_ptr, t, W, RATIO: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr):
    """Token t's sequence, first window position, window slots and slots in all (window, then compressed)."""
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
    return s, lo, n_win, n_all


@triton.jit
def _slot_offset(i, valid, t, s, lo, n_win, wtab_ptr, wtab_stride, ftab_ptr, ftab_stride, sel_ptr, COMP_OFF,
                 BS: tl.constexpr, RATIO: tl.constexpr, PER_BLOCK: tl.constexpr, HD: tl.constexpr, MODE: tl.constexpr,
                 TOPK: tl.constexpr):
    """Slots i's key rows as element offsets from the window pool's base (the compressed pool COMP_OFF past it), and
    which are real (valid, less the CSA picks that are -1 padding)."""
    in_win = i < n_win
    p = lo + i
    wblk = tl.load(wtab_ptr + s * wtab_stride + p // BS, mask=in_win & valid, other=0)
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
    return off, valid


@triton.jit(do_not_specialize=["wtab_stride", "ftab_stride"])
def _slot_offsets_kernel(pos_ptr, seq_ptr, wtab_ptr, wtab_stride, replay_ptr, ftab_ptr, ftab_stride, sel_ptr, offs_ptr,
                         W, COMP_OFF, S, BS: tl.constexpr, RATIO: tl.constexpr, PER_BLOCK: tl.constexpr,
                         HD: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """offs[t, i] = token t's slot i's key row (_slot_offset), NO_KEY where it has none: once a token, for the
    attention kernel to read, where each of its threads would work it out for each of its rows at every key step."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s, lo, n_win, n_all = _token_slots(pos_ptr, seq_ptr, replay_ptr, t, W, RATIO, MODE, TOPK)
    off, valid = _slot_offset(i, i < n_all, t, s, lo, n_win, wtab_ptr, wtab_stride, ftab_ptr, ftab_stride, sel_ptr,
                              COMP_OFF, BS, RATIO, PER_BLOCK, HD, MODE, TOPK)
    tl.store(offs_ptr + t.to(tl.int64) * S + i, tl.where(valid, off, NO_KEY), mask=i < S)


@triton.jit(do_not_specialize=["wtab_stride", "ftab_stride"])  # table widths vary per eager step
def _paged_attention_kernel(
    q_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, seq_ptr, win_ptr, wtab_ptr, wtab_stride,
    replay_ptr, ftab_ptr, ftab_stride, sel_ptr, sink_ptr, scale, H, W, COMP_OFF, cos_ptr, sin_ptr,
    BS: tl.constexpr, RATIO: tl.constexpr, PER_BLOCK: tl.constexpr, HD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, TOPK: tl.constexpr, NSPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, R: tl.constexpr = 0, sem_ptr=None, COMBINE_LAST: tl.constexpr = False,
    CB_H: tl.constexpr = 8, CB_D: tl.constexpr = 128, PDL: tl.constexpr = False, offs_ptr=None,
    OFFS_W: tl.constexpr = 0,
):
    """COMBINE_LAST (NSPLIT > 1): the last split of a (token, head block) to finish joins the partials (a counter
    per pair at sem_ptr, kernels/semaphores.py), in _combine_kernel's CB_H x CB_D slices: no combine launch.
    OFFS_W > 0: each slot's key row read from offs_ptr ([T, OFFS_W], _slot_offsets_kernel's), not worked out from
    the tables and picks by every thread for its rows at each key step."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    col0 = tl.program_id(2) // NSPLIT * BLOCK_D  # axis 2: (column block, split); splits take whole rows
    dv = col0 + tl.arange(0, BLOCK_D)
    j = tl.program_id(2) % NSPLIT
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * H + heads)[:, None] * HD + d[None, :], mask=hmask[:, None], other=0.0)
    s, lo, n_win, n_all = _token_slots(pos_ptr, seq_ptr, replay_ptr, t, W, RATIO, MODE, TOPK)
    per_split = tl.cdiv(n_all, NSPLIT)
    s_lo = j * per_split
    s_hi = tl.minimum(s_lo + per_split, n_all)
    qk_scale = scale * LOG2E  # exp2 below
    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    for start in range(s_lo, s_hi, BLOCK_N):
        i = start + n_off
        valid = i < s_hi
        if OFFS_W > 0:
            off = tl.load(offs_ptr + t.to(tl.int64) * OFFS_W + i, mask=valid, other=NO_KEY)
            valid = valid & ((off & 1) == 0)
        else:
            off, valid = _slot_offset(i, valid, t, s, lo, n_win, wtab_ptr, wtab_stride, ftab_ptr, ftab_stride, sel_ptr,
                                      COMP_OFF, BS, RATIO, PER_BLOCK, HD, MODE, TOPK)
        # rows of 16-byte multiples: the axis analysis loses that through the select, and without it no cp.async
        kp = win_ptr + tl.multiple_of(off, 16)
        k = tl.load(kp[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
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
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_i, sink)
        l_all = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
        o = acc * (tl.exp2(m_i - m_all) / l_all)[:, None]
        _store_out(out_ptr, o, t, heads, hmask, col0, cos_ptr, sin_ptr, H, HD, R, BLOCK_D)
    else:  # partials in base 2; BLOCK_D == HD here
        row = (t * H + heads) * NSPLIT + j
        tl.store(part_m_ptr + row, m_i, mask=hmask)
        tl.store(part_l_ptr + row, l_i, mask=hmask)
        tl.store(part_acc_ptr + row[:, None] * HD + d[None, :], acc, mask=hmask[:, None])
        if COMBINE_LAST:
            tl.debug_barrier()  # every thread's partials are stored before the counter's release
            tile = sem_ptr + t * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(tile, 1, sem="acq_rel") == NSPLIT - 1:
                tl.atomic_xchg(tile, 0)  # zero again (CUDA graphs replay it as is)
                for h0 in range(0, BLOCK_H, CB_H):
                    hh = tl.program_id(1) * BLOCK_H + h0 + tl.arange(0, CB_H)
                    for c0 in range(0, HD, CB_D):
                        _combine_tile(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, t, hh, hh < H, c0, H,
                                      cos_ptr, sin_ptr, HD, CB_H, CB_D, NSPLIT, R, True)


@triton.jit
def _combine_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, H, cos_ptr, sin_ptr,
                    HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr,
                    R: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (token, heads, columns): its own small slice, so the partials of one decode token are read by many
    programs at once (one program per 16 heads read 512 KB each for V4's 64 x 512 at 16 splits)."""
    wait_and_release(PDL)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_tile(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, tl.program_id(0), heads, heads < H,
                  tl.program_id(2) * BLOCK_D, H, cos_ptr, sin_ptr, HD, BLOCK_H, BLOCK_D, NSPLIT, R, False)


@triton.jit
def _combine_tile(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, t, heads, hmask, col0, H, cos_ptr, sin_ptr,
                  HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr,
                  R: tl.constexpr, VOLATILE: tl.constexpr):
    """Token t's output at `heads`, columns col0 + (0..BLOCK_D), from the splits' partials. VOLATILE: the partials
    were stored by other programs of this launch (COMBINE_LAST), so read from L2, never a stale L1 line."""
    d = col0 + tl.arange(0, BLOCK_D)
    sp = tl.arange(0, NSPLIT)
    rows = (t * H + heads)[:, None] * NSPLIT + sp[None, :]
    m = tl.load(part_m_ptr + rows, mask=hmask[:, None], other=-float("inf"), volatile=VOLATILE)
    l = tl.load(part_l_ptr + rows, mask=hmask[:, None], other=0.0, volatile=VOLATILE)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
    m_all = tl.maximum(tl.max(m, axis=1), sink)
    w = tl.exp2(m - m_all[:, None])
    l_all = tl.sum(l * w, axis=1) + tl.exp2(sink - m_all)
    o = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for i in tl.static_range(NSPLIT):
        wi = tl.sum(tl.where(sp[None, :] == i, w, 0.0), axis=1)
        a = tl.load(part_acc_ptr + ((t * H + heads) * NSPLIT + i)[:, None] * HD + d[None, :], mask=hmask[:, None],
                    other=0.0, volatile=VOLATILE)
        o += a * wi[:, None]
    _store_out(out_ptr, o / l_all[:, None], t, heads, hmask, col0, cos_ptr, sin_ptr, H, HD, R, BLOCK_D)


# Prefill chunks (PREFILL_T tokens or more), and V4's heads (64 x 512) from WGMMA_MIN_T tokens (split for few): the
# tiles that measured fastest for every branch (tools/bench_attention_prefill.py, H200, 2048 tokens at position
# 2048: CSA 1.20 ms, HCA 0.32 ms, docs/perf/h200-2026-12-03-s11/final_attention.log): (BLOCK_H, BLOCK_N,
# num_warps, BLOCK_D, num_stages); other head counts: WGMMA_TILES_SMALL with as many heads as fit 64 (BLOCK_D None:
# the whole head_dim)
PREFILL_T = 256
WGMMA_TILES = (64, 64, 8, 512, 2)
WGMMA_TILES_SMALL = (16, 32, 4, None, 3)
# From this many tokens V4's heads take the wgmma tiles at decode too (tools/bench_attention_prefill.py, H200,
# docs/perf/h200-2026-12-03-s11/sizes_ctx1024_attention.log, context 1024, CSA: 16 tokens
# 28.1 us at 8 splits vs 45.1 on the small tiles, 32 tokens 33.5 vs 79.7, 150 tokens 113.3 vs 230.0; one token
# 18.3 us on the small tiles vs 26.3 at best on the wgmma ones)
WGMMA_MIN_T = 16
COMBINE_BLOCK_H, COMBINE_BLOCK_D = 8, 128  # the split combine's slice per program


def _wgmma_tiles(H: int, hd: int) -> tuple:
    if H >= 64 and hd == 512:
        return WGMMA_TILES
    bh, bn, warps, _, stages = WGMMA_TILES_SMALL
    return max(bh, min(64, triton.next_power_of_2(H))), bn, warps, hd, stages


def comp_offset(window_pool: torch.Tensor, comp_pool: torch.Tensor | None) -> int | None:
    """The compressed pool's first element counted from the window pool's (COMP_OFF), or None where one base
    pointer cannot reach both: other dtypes, or an offset that is not whole 16-byte vectors."""
    if comp_pool is None:
        return 0
    gap = comp_pool.data_ptr() - window_pool.data_ptr()
    if comp_pool.dtype != window_pool.dtype or gap % 16 or not comp_pool.is_contiguous():
        return None
    return gap // window_pool.element_size()


def splits(rows: int, wgmma: bool) -> int:
    """Splits of each token's keys for `rows` (tokens x head blocks) programs: the wgmma tiles as many as stay within
    one wave (one more doubling measured slower at 16 / 32 / 150 tokens), the small tiles about two waves."""
    n = 1
    while n < 16 and (2 * rows * n <= quant_configs.SMS if wgmma else rows * n < 2 * quant_configs.SMS):
        n *= 2
    # the interpreter runs programs one by one: two splits still take the combine path, without the GPU's fan-out
    return min(n, 2) if _INTERPRET else n


OFFSETS_BLOCK = 128  # slots a program of _slot_offsets_kernel


def _slot_offsets(positions, token_seq, window_tables, replay_starts, full_tables, selected, window, comp_off, bs,
                  ratio, comp_pool, hd):
    """The kernel variant attn_offsets (kernels/variants.py): every token's slots' key rows, [T, window + topk]
    int64 element offsets, NO_KEY where a slot has none, for the attention kernel to read. CSA layers only: a window
    layer's rows are consecutive positions, cheaper worked out than loaded (sm_90 offline, Triton 3.6: 983
    instructions a key step against 1,205), and an HCA layer's slots grow with the context, not bounded by a step."""
    T, topk = positions.shape[0], selected.shape[1]
    width = window + topk
    offs = torch.empty(T, width, dtype=torch.int64, device=positions.device)
    _slot_offsets_kernel[(T, triton.cdiv(width, OFFSETS_BLOCK))](
        positions, token_seq, window_tables, window_tables.stride(0), replay_starts, full_tables,
        full_tables.stride(0), selected.contiguous(), offs, window, comp_off, width, BS=bs, RATIO=ratio,
        PER_BLOCK=comp_pool.shape[1], HD=hd, MODE=2, TOPK=topk, BLOCK=OFFSETS_BLOCK, **pdl.options(positions))
    return offs


def paged_attention_fused(q, positions, token_seq, window_pool, window_tables, replay_starts, sliding_window,
                          comp_pool, full_tables, ratio, selected, sinks, scale, nsplit: int | None = None,
                          block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                          wgmma_tiles: tuple | None = None, inv_rope: tuple | None = None):
    """block_h, block_n, num_warps: the small tiles (mma.sync; few heads); wgmma_tiles: (BLOCK_H, BLOCK_N,
    num_warps, BLOCK_D, num_stages), the wgmma ones; nsplit: splits of a token's keys (whole-row tiles only);
    tools/bench_attention_prefill.py sweeps them. None: the defaults below. inv_rope (cos, sin): the output's
    last 2 * cos.shape[-1] columns rotated back (kernels.reference.apply_rope), in the store with the fusion
    switch inv_rope_out (kernels/fusions.py), else by kernels.fused_rope's launch after."""
    half = inv_rope[0].shape[-1] if inv_rope is not None else 0
    if inv_rope is not None and (not fusions.on("inv_rope_out") or half & (half - 1)):  # the store's pairs: 2^n
        out = paged_attention_fused(q, positions, token_seq, window_pool, window_tables, replay_starts, sliding_window,
                                    comp_pool, full_tables, ratio, selected, sinks, scale, nsplit, block_h, block_n,
                                    num_warps, wgmma_tiles)
        return apply_rope_fused(out, *inv_rope)
    T, H, hd = q.shape
    assert hd & (hd - 1) == 0, "head_dim must be a power of two for the fused attention kernel"
    q = q.contiguous()
    out = torch.empty_like(q)
    mode = 0 if comp_pool is None else (2 if selected is not None else 1)
    topk = selected.shape[1] if selected is not None else 1
    comp_off = comp_offset(window_pool, comp_pool)
    if comp_off is None:
        raise ValueError("paged attention: the window and compressed pools must share a dtype, be contiguous and "
                         "sit a whole number of 16-byte vectors apart")
    small_asked = block_h or block_n or num_warps
    wgmma = wgmma_tiles or not small_asked and (T >= PREFILL_T or H >= 64 and hd == 512 and T >= WGMMA_MIN_T)
    if wgmma:
        # the wgmma tiles: chunks, and V4's 64 x 512 heads from WGMMA_MIN_T tokens (a program's 64 rows are a
        # token's heads)
        block_h, block_n, warps, block_d, stages = wgmma_tiles or _wgmma_tiles(H, hd)
        block_d = block_d or hd
        if block_d < hd:
            nsplit = 1
    else:
        # every head of a token reads the same keys: more heads per program read them fewer times (big decode
        # batches); a few tokens need the smaller blocks for parallelism
        block_h = block_h or (32 if T >= 32 and H >= 32 else 16)
        block_n = block_n or (32 if hd <= 128 else 16)
        warps, block_d, stages = num_warps or (4 if hd <= 128 else 8), hd, 3
    head_blocks = triton.cdiv(H, block_h)
    if nsplit is None:  # few tokens: split their keys for programs enough to fill the GPU
        nsplit = splits(T * head_blocks, bool(wgmma))
    if nsplit > 1:
        part_m = torch.empty(T, H, nsplit, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(T, H, nsplit, hd, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = sinks
    sinks = sinks.float().contiguous()
    cos, sin = (t.contiguous() for t in inv_rope) if inv_rope is not None else (sinks, sinks)
    rope_r = 2 * inv_rope[0].shape[-1] if inv_rope is not None else 0
    cb_h, cb_d = min(COMBINE_BLOCK_H, block_h), min(COMBINE_BLOCK_D, hd)
    combine_last = nsplit > 1 and fusions.on("combine_last")
    sem = semaphores(q.device, T * head_blocks) if combine_last else sinks
    offs = _slot_offsets(positions, token_seq, window_tables, replay_starts, full_tables, selected, sliding_window,
                         comp_off, window_pool.shape[1], ratio, comp_pool, hd) if (
        wgmma and mode == 2 and variants.on("attn_offsets")) else None
    _paged_attention_kernel[(T, head_blocks, hd // block_d * nsplit)](
        q, out, part_m, part_l, part_acc, positions, token_seq, window_pool, window_tables, window_tables.stride(0),
        replay_starts, full_tables if full_tables is not None else window_tables,
        full_tables.stride(0) if full_tables is not None else 0,
        selected.contiguous() if selected is not None else positions, sinks, scale, H, sliding_window, comp_off, cos,
        sin, BS=window_pool.shape[1], RATIO=max(ratio, 1), PER_BLOCK=comp_pool.shape[1] if comp_pool is not None else 1,
        HD=hd, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, MODE=mode, TOPK=topk, NSPLIT=nsplit,
        DOT_F32=_INTERPRET, R=rope_r, sem_ptr=sem, COMBINE_LAST=combine_last, CB_H=cb_h, CB_D=cb_d,
        num_warps=warps, num_stages=stages, offs_ptr=offs, OFFS_W=0 if offs is None else offs.shape[1], **pdl.options(q),
    )
    if nsplit > 1 and not combine_last:
        _combine_kernel[(T, triton.cdiv(H, cb_h), hd // cb_d)](
            out, part_m, part_l, part_acc, sinks, H, cos, sin, HD=hd, BLOCK_H=cb_h, BLOCK_D=cb_d, NSPLIT=nsplit,
            R=rope_r, **pdl.options(out))
    return out
