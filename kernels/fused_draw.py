"""A sampled row's token without sorting its vocabulary: kernels.reference.sample_draw in one program a row.

torch's way (sort the row, softmax, cumsum, scatter back) sorts [rows, V] float32 whenever a row asks for top-k or
top-p: at 150 rows x 129,280 that cost ~3.6 ms a step on the H100 (a 43-layer decode step is ~41 ms). Here each
program reads its row a few times:
 1. the largest y = x / T (and the smallest finite one);
 2. top-k's k-th largest, then top-p's cut, each a search over values: a pass counts (top-p: weighs) the kept
    entries at or above NP probes inside the bracket known to hold the answer and keeps the probe interval that
    holds it (the bracket narrows ~NP-fold, to the exact smallest and largest entries in it), until the bracket
    holds at most CAP entries: those are gathered, sorted in registers and the answer read off exactly (or the
    bracket holds one value: the answer);
 3. the kept mass per block, then u x the total located in its block and, in that block, its token.
Masses add float32 entries in float64, so a token differs from the reference's only where u x the total lies
within float32 rounding of one of its edges (or top-p's mass within rounding of top_p).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FMAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # float32's largest: +inf logits and overflowed scaled ones become it
BLOCK = 4096  # entries a pass reads at a time (a gathering or block-summing pass reduces once a block)
SEARCH_BLOCK = 256  # a search pass's, which keeps per-entry partials for each probe and reduces once a pass
NP = 8  # probes a search pass tests
CAP = 2048  # entries a search gathers and sorts to resolve
NUM_WARPS = 8
MAX_PASSES = 48  # a bound the narrowing never reaches (each pass splits the bracket's distinct values)


@triton.jit
def _scaled(base, cols, V, T):
    """y = x / T as kernels.reference.sample_filter scales it: NaN -> -inf, +inf and overflow -> FMAX."""
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), tl.minimum(x, FMAX))
    return tl.minimum(x / T, FMAX)


@triton.jit
def _kept(d, e, minp, cut):
    return (d > float("-inf")) & (e >= minp) & (d >= cut)


@triton.jit
def _pick(vec, idx, at):
    """vec[at] as a scalar (idx: vec's positions)."""
    return tl.sum(tl.where(idx == at, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _cut(base, V, T, top, minp, cut, k, p, a, b, gathered,
         BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
         MAX_PASSES: tl.constexpr):
    """top-k's k-th largest kept d (BY_COUNT; -inf where fewer than k are kept) or top-p's cut (the smallest kept d
    whose kept mass strictly above it is below p x the kept mass), over entries kept by min_p and >= cut. The
    answer v is the smallest value whose statistic (count / mass) at or above any value past it is below the
    target: a probe t with stat(>= t) < target has v < t, else v >= t. [a, b]: where to probe first."""
    j = tl.arange(0, NP)
    lo = -float("inf")
    hi = float("inf")
    above_n = 0  # kept entries >= hi
    above_m = tl.zeros((), tl.float64)  # their mass
    inside = 0  # kept entries in [lo, hi)
    target = tl.zeros((), tl.float64)
    known = False  # after the first pass: inside, target, and [a, b] = the exact extremes in [lo, hi)
    done = False
    answer = -float("inf")
    passes = 0
    while not done:
        if known & (inside <= CAP):
            # gather the bracket's entries, sort them, read the answer off
            n = 0
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                d = _scaled(base, cols, V, T) - top
                e = tl.exp(d)
                take = _kept(d, e, minp, cut) & (d >= lo) & (d < hi)
                slot = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(gathered + slot, d, mask=take & (slot < CAP))
                n += tl.sum(take.to(tl.int32), axis=0)
            tl.debug_barrier()  # the stores above, read back by the whole program
            c = tl.arange(0, CAP)
            vals = tl.sort(tl.load(gathered + c, mask=c < n, other=-float("inf")), descending=True)
            if BY_COUNT:
                at = tl.minimum(tl.maximum(k - above_n - 1, 0), n - 1)
            else:
                w = tl.where(c < n, tl.exp(vals), 0.0).to(tl.float64)
                before = above_m + tl.cumsum(w, axis=0) - w
                at = tl.maximum(tl.sum(((before < target) & (c < n)).to(tl.int32), axis=0) - 1, 0)
            answer = _pick(vals, c, at)
            done = True
        elif known & (a == b):
            answer = a  # one value left in the bracket
            done = True
        else:
            t = a + (b - a) * (j + 1).to(tl.float32) / NP
            t = tl.where(j == NP - 1, b, t)
            # per-lane partials, reduced once a pass: a reduction across the program costs a barrier
            n_ge = tl.zeros((SB, NP), tl.int32)  # kept entries in [t_j, hi)
            m_ge = tl.zeros((SB, NP), tl.float64)
            min_ge = tl.full((SB, NP), float("inf"), tl.float32)  # the smallest in [t_j, hi)
            max_lt = tl.full((SB, NP), -float("inf"), tl.float32)  # the largest in [lo, t_j)
            n_in = tl.zeros((SB,), tl.int32)
            m_in = tl.zeros((SB,), tl.float64)
            min_in = tl.full((SB,), float("inf"), tl.float32)
            max_in = tl.full((SB,), -float("inf"), tl.float32)
            for off in range(0, V, SB):
                cols = off + tl.arange(0, SB)
                d = _scaled(base, cols, V, T) - top
                e = tl.exp(d)
                take = _kept(d, e, minp, cut) & (d >= lo) & (d < hi)
                at_or_above = d[:, None] >= t[None, :]
                ge = take[:, None] & at_or_above
                lt = take[:, None] & ~at_or_above
                n_ge += ge.to(tl.int32)
                min_ge = tl.minimum(min_ge, tl.where(ge, d[:, None], float("inf")))
                max_lt = tl.maximum(max_lt, tl.where(lt, d[:, None], -float("inf")))
                n_in += take.to(tl.int32)
                min_in = tl.minimum(min_in, tl.where(take, d, float("inf")))
                max_in = tl.maximum(max_in, tl.where(take, d, -float("inf")))
                if not BY_COUNT:
                    m_ge += tl.where(ge, e[:, None], 0.0).to(tl.float64)
                    m_in += tl.where(take, e, 0.0).to(tl.float64)
            n_ge = tl.sum(n_ge, axis=0)
            m_ge = tl.sum(m_ge, axis=0)
            min_ge = tl.min(min_ge, axis=0)
            max_lt = tl.max(max_lt, axis=0)
            n_in = tl.sum(n_in, axis=0)
            m_in = tl.sum(m_in, axis=0)
            min_in = tl.min(min_in, axis=0)
            max_in = tl.max(max_in, axis=0)
            fewer = False  # than k kept: nothing to cut
            if not known:  # the whole kept set: its size (top-k) or mass (top-p) sets the target
                if BY_COUNT:
                    target = k.to(tl.float64)
                    fewer = n_in < k
                else:
                    target = p.to(tl.float64) * m_in
            if BY_COUNT:
                stat = above_n + n_ge
            else:
                stat = above_m + m_ge
            if fewer:
                done = True
            else:
                first = tl.min(tl.where(stat.to(tl.float64) < target, j, NP), axis=0)  # v lies below t[first]
                if first == 0:
                    new_lo = lo
                    n_lo = n_in
                    a = min_in
                else:
                    new_lo = _pick(t, j, first - 1)
                    n_lo = _pick(n_ge, j, first - 1)
                    a = _pick(min_ge, j, first - 1)
                if first < NP:
                    hi = _pick(t, j, first)
                    n_hi = _pick(n_ge, j, first)
                    above_n += n_hi
                    if not BY_COUNT:
                        above_m += _pick(m_ge, j, first)
                    b = _pick(max_lt, j, first)
                else:
                    n_hi = 0
                    b = max_in
                lo = new_lo
                inside = n_lo - n_hi
                known = True
                if inside <= 0:  # the two sides' sums rounded across the target: any cut in [lo, hi) is theirs
                    answer = lo
                    done = True
        passes += 1
        if passes >= MAX_PASSES:
            answer = a
            done = True
    return answer


@triton.jit
def _draw_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, u_ptr, out_ptr, cuts_ptr,
                 gathered_ptr, sums_ptr,
                 HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
                 SB: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, NBLOCKS: tl.constexpr, MAX_PASSES: tl.constexpr):
    r = tl.program_id(0)
    base = x_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
    T = tl.load(temp_ptr + r)
    top = tl.full((BLOCK,), -float("inf"), tl.float32)
    low = tl.full((BLOCK,), float("inf"), tl.float32)  # the smallest finite y
    for off in range(0, V, BLOCK):
        y = _scaled(base, off + tl.arange(0, BLOCK), V, T)
        top = tl.maximum(top, y)
        low = tl.minimum(low, tl.where(y > float("-inf"), y, float("inf")))
    top = tl.max(top, axis=0)
    low = tl.min(low, axis=0)
    token = -1
    cut = -float("inf")
    if top > float("-inf"):
        minp = 0.0
        if HAS_MIN_P:
            minp = tl.load(minp_ptr + r)
        gathered = gathered_ptr + r.to(tl.int64) * CAP
        zero = top * 0.0  # d of the top entry, as a value the searches may carry
        if HAS_TOP_K:
            k = tl.load(topk_ptr + r).to(tl.int32)
            if k < V:
                cut = _cut(base, V, T, top, minp, cut, k, 1.0, tl.maximum(low - top, -FMAX), zero, gathered, True,
                           BLOCK, SB, NP, CAP, MAX_PASSES)
        if HAS_TOP_P:
            p = tl.load(topp_ptr + r)
            if p < 1.0:
                # the cut lies where the entries below it weigh 1 - p at most: above -log(V / (1 - p)) in d
                a = tl.maximum(tl.maximum(low - top, -FMAX), -tl.log(V / (1.0 - p)) - 1.0)
                cut = tl.maximum(cut, _cut(base, V, T, top, minp, cut, 0, p, a, zero, gathered, False, BLOCK, SB,
                                           NP, CAP, MAX_PASSES))
        # the kept mass a block, then the block and the token where the cumulative mass passes u x the total
        total = tl.zeros((), tl.float64)
        sums = sums_ptr + r.to(tl.int64) * NBLOCKS
        for i in range(0, tl.cdiv(V, BLOCK)):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            d = _scaled(base, cols, V, T) - top
            e = tl.exp(d)
            s = tl.sum(tl.where(_kept(d, e, minp, cut), e, 0.0).to(tl.float64), axis=0)
            tl.store(sums + i, s)
            total += s
        tl.debug_barrier()
        goal = tl.load(u_ptr + r).to(tl.float64) * total
        bi = tl.arange(0, NBLOCKS)
        block_sums = tl.load(sums + bi, mask=bi < tl.cdiv(V, BLOCK), other=0.0)
        through = tl.cumsum(block_sums, axis=0)
        chosen = tl.sum((through <= goal).to(tl.int32), axis=0)
        last_nonempty = tl.max(tl.where(block_sums > 0, bi, 0), axis=0)
        chosen = tl.minimum(chosen, last_nonempty)  # a goal rounded up to the total
        before = _pick(through - block_sums, bi, chosen)
        cols = chosen * BLOCK + tl.arange(0, BLOCK)
        d = _scaled(base, cols, V, T) - top
        e = tl.exp(d)
        kept = _kept(d, e, minp, cut)
        running = before + tl.cumsum(tl.where(kept, e, 0.0).to(tl.float64), axis=0)
        token = tl.min(tl.where(kept & (running > goal), cols, 2147483647), axis=0)
        token = tl.where(token == 2147483647, tl.max(tl.where(kept, cols, -1), axis=0), token)
    tl.store(out_ptr + r, token.to(tl.int64))
    tl.store(cuts_ptr + r, cut)


def _per_row(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One value a row, contiguous (an expanded tensor repeats one value at stride 0)."""
    return t.to(dtype).contiguous()


def sample_draw_fused(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                      u: torch.Tensor, cuts: torch.Tensor | None = None, block: int = BLOCK,
                      search_block: int = SEARCH_BLOCK, probes: int = NP, cap: int = CAP,
                      num_warps: int = NUM_WARPS) -> torch.Tensor:
    """kernels.reference.sample_draw: [w] int64 tokens, -1 where nothing is left. `cuts` ([w] float32), if given,
    receives each row's cut in d (the kept tokens: kept by min_p and d >= cut; -inf: none); block / probes / cap
    / search_block / num_warps change the passes' sizes (tests walk every branch on small rows with them)."""
    w, V = rows.shape[0], logits.shape[-1]
    dev = logits.device
    out = torch.empty(w, dtype=torch.long, device=dev)
    if w == 0:
        return out
    cuts = torch.empty(w, dtype=torch.float32, device=dev) if cuts is None else cuts
    nblocks = triton.next_power_of_2(triton.cdiv(V, block))
    gathered = torch.empty(w, cap, dtype=torch.float32, device=dev)
    sums = torch.empty(w, nblocks, dtype=torch.float64, device=dev)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _draw_kernel[(w,)](
        logits, logits.stride(0), V, _per_row(rows, torch.long), _per_row(temperature, torch.float32),
        _per_row(top_k if top_k is not None else rows, torch.long),
        _per_row(top_p if top_p is not None else temperature, torch.float32),
        _per_row(min_p if min_p is not None else temperature, torch.float32), _per_row(u, torch.float64), out, cuts,
        gathered, sums,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None, BLOCK=block,
        SB=search_block, NP=probes, CAP=cap, NBLOCKS=nblocks, MAX_PASSES=MAX_PASSES, num_warps=num_warps)
    return out
