"""The lightning indexer's selection at a cost that follows what each token sees, not the row width (kernel variant
indexer_select, kernels/variants.py).

Its rows are as wide as the longest sequence a call may hold: a CUDA graph sizes them for max_model_len, so a
decode at a 1K context in a server of 128K reads rows of 32K entries, and fused_indexer's path scores every one
(-inf past the visible ones), then sorts them (up to 4,096 entries) or runs torch.topk over them. Here each token
scores only the entries it sees (a few programs a token, each walking blocks of entries up to that count) and
selects in passes over those entries alone:

- at most TOPK seen: every one, in index order, unscored (as fused_indexer does);
- up to SORT_SEEN: fused_indexer's sort of those entries alone (its cost at an 8K-token server's rows, whatever
  the server's max_model_len);
- more: a radix select over the scores' order-preserving 32-bit keys, eight bits a pass (a histogram of the keys
  that match the digits chosen so far: the bucket holding the TOPK-th largest gives the next eight bits), then a
  pass that keeps the keys above that threshold and, of the keys equal to it, the lowest indices (the reference's
  tie order: kernels.reference.topk_by_score_then_index), written in index order.

The same set as kernels.reference.indexer_topk (which lists it best first; the fused attention needs only the picks
before the -1 padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl, quant_configs
from kernels.fused_attention import _INTERPRET
from kernels.fused_compress import rows_unit_stride
from kernels.fused_indexer import score_block, sorted_picks
from kernels.pdl import wait_and_release

BLOCK_E = 64  # entries a score block
CHUNK = 1024  # entries a select pass reads at a time
SORT_SEEN = 2048  # up to this many entries seen, a token's picks come from one sort of them


@triton.jit(do_not_specialize=["ftab_stride", "n_max"])
def _visible_scores_kernel(q_ptr, w_ptr, w_stride, w_scale, keys_ptr, ftab_ptr, ftab_stride, pos_ptr, seq_ptr,
                           out_ptr, n_max, H, RATIO, PER_BLOCK, scale, TOPK: tl.constexpr, HD: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, DOT_F32: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Program (token, p): the token's score blocks p, p + P, ... below what it sees; nothing for a token that sees
    at most TOPK (all picked) and nothing past what it sees (never read)."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    n_vis = (tl.load(pos_ptr + t) + 1) // RATIO
    if n_vis > TOPK:
        for b in range(tl.program_id(1), tl.cdiv(n_vis, BLOCK_E), tl.num_programs(1)):
            e = b * BLOCK_E + tl.arange(0, BLOCK_E)
            res = score_block(q_ptr, w_ptr, w_stride, w_scale, keys_ptr, ftab_ptr, ftab_stride, seq_ptr, t, e, n_vis,
                              H, PER_BLOCK, scale, HD, BLOCK_H, DOT_F32)
            tl.store(out_ptr + t.to(tl.int64) * n_max + e, res, mask=e < n_vis)


@triton.jit
def _order_key(x):
    """float32 -> int64 in [0, 2^32) ordered as the floats are (-0.0 as +0.0, the reference's order)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits >= 0, bits + 2147483648, -1 - bits)


@triton.jit(do_not_specialize=["n_max"])
def _radix_topk_kernel(scores_ptr, pos_ptr, out_ptr, n_max, RATIO, TOPK: tl.constexpr, OUT_BLOCK: tl.constexpr,
                       CHUNK: tl.constexpr, SORT_SEEN: tl.constexpr, PDL: tl.constexpr = False):
    """One token's TOPK picks among the n_vis entries it sees (module docstring): all of them, or by a sort of them
    (best first), or by a radix select (in index order)."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    n_vis = (tl.load(pos_ptr + t) + 1) // RATIO
    row = scores_ptr + t.to(tl.int64) * n_max
    if n_vis <= TOPK:
        o = tl.arange(0, OUT_BLOCK)
        tl.store(out_ptr + t * TOPK + o, tl.where(o < n_vis, o, -1).to(tl.int64), mask=o < TOPK)
    elif n_vis <= SORT_SEEN:
        e, picks = sorted_picks(row, n_vis, n_vis, SORT_SEEN)
        tl.store(out_ptr + t * TOPK + e, picks, mask=e < TOPK)
    else:
        c = tl.arange(0, CHUNK)
        bins = tl.arange(0, 256)
        prefix = tl.zeros((), tl.int64)  # the threshold key's digits chosen so far
        need = tl.full((), TOPK, tl.int32)  # picks still to make among the keys that match them
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros((256,), tl.int32)
            for c0 in range(0, n_vis, CHUNK):
                e = c0 + c
                key = _order_key(tl.load(row + e, mask=e < n_vis, other=0.0))
                match = (e < n_vis) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
            at_or_above = tl.cumsum(hist, 0, reverse=True)  # keys in bucket b or a higher one
            b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)  # the bucket of the need-th largest
            need -= tl.sum(tl.where(bins == b, at_or_above - hist, 0), 0)  # those above it are all picked
            prefix = prefix | (b.to(tl.int64) << shift)
        written = tl.zeros((), tl.int32)
        ties = tl.zeros((), tl.int32)  # keys equal to the threshold seen so far: the first `need` are picked
        for c0 in range(0, n_vis, CHUNK):
            e = c0 + c
            key = _order_key(tl.load(row + e, mask=e < n_vis, other=0.0))
            seen = e < n_vis
            tie = seen & (key == prefix)
            take = (seen & (key > prefix)) | (tie & (ties + tl.cumsum(tie.to(tl.int32), 0) <= need))
            at = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_ptr + t * TOPK + at, e.to(tl.int64), mask=take & (at < TOPK))  # never past the row
            written += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(tie.to(tl.int32), 0)


def indexer_topk_select(iq, iw, index_pool, full_tables, positions, token_seq, ratio, topk, max_pos=None,
                        one_per_seq=False, iw_scale=1.0):
    """kernels.fused_indexer.indexer_topk_fused's selection (the same signature and set), at the cost of what each
    token sees."""
    T, H, hd = iq.shape
    n = (int(max_pos if max_pos is not None else positions.max()) + 1) // ratio
    if n == 0 or T == 0:
        return torch.full((T, topk), -1, dtype=torch.long, device=iq.device)
    assert hd & (hd - 1) == 0 and hd >= 16, "index_head_dim must be a power of two >= 16"
    out = torch.empty(T, topk, dtype=torch.long, device=iq.device)  # every slot written
    scores = torch.empty(T, n if n > topk else 0, dtype=torch.float32, device=iq.device)  # read below n_vis only
    if n > topk:
        iw = rows_unit_stride(iw)
        programs = max(1, min(triton.cdiv(n, BLOCK_E), triton.cdiv(2 * quant_configs.SMS, T)))
        _visible_scores_kernel[(T, programs)](
            iq.contiguous(), iw, iw.stride(0), iw_scale, index_pool, full_tables, full_tables.stride(0), positions,
            token_seq, scores, n, H, ratio, index_pool.shape[1], hd**-0.5, TOPK=topk, HD=hd,
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_E=BLOCK_E, DOT_F32=_INTERPRET, num_warps=4,
            **pdl.options(iq))
    # the sort's width: SORT_SEEN, or a narrower row's (as fused_indexer sorts it), never under the picks
    sort_block = max(triton.next_power_of_2(topk), min(SORT_SEEN, triton.next_power_of_2(n)))
    _radix_topk_kernel[(T,)](scores, positions, out, scores.shape[1], ratio, TOPK=topk,
                             OUT_BLOCK=triton.next_power_of_2(topk), CHUNK=CHUNK, SORT_SEEN=sort_block,
                             num_warps=4 if sort_block <= 1024 else 8, **pdl.options(iq))
    return out
