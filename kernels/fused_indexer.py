"""Fused lightning-indexer scores over the paged index-key pool, then one top-k for all tokens.

score[t, e] = scale * sum_h w[t, h] * relu(q[t, h] . k[e]) for every compressed entry e the
query token t sees ((e + 1) * ratio <= pos + 1), -inf beyond. One program per (token, block of
entries): the token's heads form the M side of one matmul against a tile of keys read straight
from the paged pool, so no [tokens, entries, dim] gather is ever materialised. Prefill chunks of
many sequences and CUDA-graph decode batches take the same path (no per-sequence loop, no host
sync). Same signature as kernels.reference.indexer_topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fused_attention import _INTERPRET
from kernels.fused_compress import rows_unit_stride
from kernels.pdl import wait_and_release
from kernels.reference import topk_by_score_then_index


@triton.jit(do_not_specialize=["ftab_stride", "n_max"])  # sizes vary per eager step
def _indexer_scores_kernel(q_ptr, w_ptr, w_stride, w_scale, keys_ptr, ftab_ptr, ftab_stride, pos_ptr, seq_ptr, out_ptr, n_max, H,
                           RATIO, PER_BLOCK, scale, HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                           DOT_F32: tl.constexpr, SKIP_FIT: tl.constexpr = 0, PDL: tl.constexpr = False):
    """SKIP_FIT > 0: a token that sees at most SKIP_FIT entries gets no scores (its row left as it was): the top-k of
    that many picks every one it sees, whatever they score (_topk_kernel)."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    n_vis = (tl.load(pos_ptr + t) + 1) // RATIO
    if SKIP_FIT > 0:
        if n_vis <= SKIP_FIT:
            return
    res = tl.full((BLOCK_E,), -float("inf"), tl.float32)
    if tl.program_id(1) * BLOCK_E < n_vis:
        res = score_block(q_ptr, w_ptr, w_stride, w_scale, keys_ptr, ftab_ptr, ftab_stride, seq_ptr, t, e, n_vis, H,
                          PER_BLOCK, scale, HD, BLOCK_H, DOT_F32)
    tl.store(out_ptr + t * n_max + e, res, mask=e < n_max)


@triton.jit
def score_block(q_ptr, w_ptr, w_stride, w_scale, keys_ptr, ftab_ptr, ftab_stride, seq_ptr, t, e, n_vis, H, PER_BLOCK,
                scale, HD: tl.constexpr, BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr):
    """Token t's scores of entries e (-inf where e >= n_vis): its heads as the M side of one dot against the keys,
    read through its sequence's block table."""
    valid = e < n_vis
    s = tl.load(seq_ptr + t)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * H + heads)[:, None] * HD + d[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + t * w_stride + heads, mask=hmask, other=0.0).to(tl.float32) * w_scale
    blk = tl.load(ftab_ptr + s * ftab_stride + e // PER_BLOCK, mask=valid, other=0)
    k = tl.load(keys_ptr + (blk * PER_BLOCK + e % PER_BLOCK)[:, None] * HD + d[None, :], mask=valid[:, None],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    sc = tl.maximum(tl.dot(q, tl.trans(k)), 0.0) * w[:, None]  # [heads, entries]
    return tl.where(valid, tl.sum(sc, axis=0) * scale, -float("inf"))


@triton.jit(do_not_specialize=["n"])
def _topk_kernel(scores_ptr, pos_ptr, out_ptr, n, RATIO, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                 OUT_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One token's top-k by a bitonic sort of (score, index) packed into int64 keys: the score's
    bits made order-preserving in the high half, the index (reversed, so ties keep the lower
    index first) in the low half. A whole row fits one program up to a few thousand entries.
    A token that sees at most TOPK entries picks every one, in index order, unsorted and its scores unread
    (_indexer_scores_kernel's SKIP_FIT leaves them unwritten): the same set. Every one of the TOPK slots is
    written (-1 past the picks; OUT_BLOCK: TOPK's power of two)."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    n_vis = (tl.load(pos_ptr + t) + 1) // RATIO
    if n_vis <= TOPK:
        o = tl.arange(0, OUT_BLOCK)
        tl.store(out_ptr + t * TOPK + o, tl.where(o < n_vis, o, -1).to(tl.int64), mask=o < TOPK)
    else:  # n >= n_vis > TOPK, so BLOCK > TOPK: the sorted row fills every slot
        e, picks = sorted_picks(scores_ptr + t * n, n, n_vis, BLOCK)
        tl.store(out_ptr + t * TOPK + e, picks, mask=e < TOPK)


@triton.jit
def sorted_picks(row_ptr, n_read, n_vis, BLOCK: tl.constexpr):
    """A row's first n_read scores (-inf past them) sorted best first, an exact tie to the lower index: (positions
    0..BLOCK, the entry at each: -1 where it is not one the token sees), as int64."""
    e = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + e, mask=e < n_read, other=-float("inf"))
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties +0.0 (the reference's order)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # IEEE order as signed integers
    packed = (key.to(tl.int64) << 32) | (BLOCK - 1 - e).to(tl.int64)
    top = tl.sort(packed, descending=True)
    idx = BLOCK - 1 - (top & 0xFFFFFFFF).to(tl.int32)
    return e, tl.where(idx < n_vis, idx, -1).to(tl.int64)


SORT_MAX = 4096  # rows up to this many entries are sorted in one program; longer ones use torch.topk


def indexer_scores_paged(iq: torch.Tensor, iw: torch.Tensor, index_pool: torch.Tensor, full_tables: torch.Tensor,
                         positions: torch.Tensor, token_seq: torch.Tensor, ratio: int, n_max: int,
                         iw_scale: float = 1.0, skip_fit: int = 0) -> torch.Tensor:
    """-> [T, n_max] fp32 scores, -inf where the entry is not (yet) visible to the token. iw: any float
    dtype and row stride (a column slice of a stacked GEMM's output), times iw_scale in fp32 here.
    skip_fit > 0: rows of tokens that see at most that many entries are left unwritten (indexer_topk_fused)."""
    T, H, hd = iq.shape
    assert hd & (hd - 1) == 0 and hd >= 16, "index_head_dim must be a power of two >= 16"
    out = torch.empty(T, n_max, dtype=torch.float32, device=iq.device)
    iw = rows_unit_stride(iw)
    BLOCK_E = 64
    _indexer_scores_kernel[(T, triton.cdiv(n_max, BLOCK_E))](
        iq.contiguous(), iw, iw.stride(0), iw_scale, index_pool, full_tables, full_tables.stride(0), positions,
        token_seq, out, n_max, H, ratio, index_pool.shape[1], hd**-0.5,
        HD=hd, BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_E=BLOCK_E, DOT_F32=_INTERPRET, SKIP_FIT=skip_fit,
        num_warps=4, **pdl.options(iq))
    return out


def indexer_topk_fused(iq, iw, index_pool, full_tables, positions, token_seq, ratio, topk, max_pos=None,
                       one_per_seq=False, iw_scale=1.0):
    """The indexer's selection per query token: [T, topk] entry indices, -1 where fewer are visible.
    max_pos (a host int) sizes the score rows; one_per_seq is accepted for the reference's sake.
    A token that sees at most topk entries picks all of them (in index order, where the reference ranks them):
    no scores are computed for it, and none at all where no token can see more (max_pos: a short prompt's
    prefill; CUDA graphs size for the longest sequence, so there each token is decided on the GPU)."""
    T = iq.shape[0]
    n = (int(max_pos if max_pos is not None else positions.max()) + 1) // ratio
    if n == 0 or T == 0:
        return torch.full((T, topk), -1, dtype=torch.long, device=iq.device)
    if n <= SORT_MAX:
        out = torch.empty(T, topk, dtype=torch.long, device=iq.device)  # the kernel writes every slot
        if n <= topk:  # every token fits: no scores read (a float placeholder keeps the sort path compiling)
            scores = out.new_empty(0, dtype=torch.float32)
        else:
            scores = indexer_scores_paged(iq, iw, index_pool, full_tables, positions, token_seq, ratio, n, iw_scale,
                                          skip_fit=topk)
        _topk_kernel[(T,)](scores, positions, out, n, ratio, TOPK=topk, BLOCK=max(16, triton.next_power_of_2(n)),
                           OUT_BLOCK=triton.next_power_of_2(topk), num_warps=4 if n <= 1024 else 8,
                           **pdl.options(iq))
        return out
    out = torch.full((T, topk), -1, dtype=torch.long, device=iq.device)
    scores = indexer_scores_paged(iq, iw, index_pool, full_tables, positions, token_seq, ratio, n, iw_scale)
    k = min(topk, n)
    idx = topk_by_score_then_index(scores, k)  # the sort kernel's tie order
    out[:, :k] = torch.where(idx < ((positions + 1) // ratio)[:, None], idx, -1)
    return out
