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
def scaled(base, cols, V, T):
    """y = x / T as kernels.reference.sample_filter scales it: NaN -> -inf, +inf and overflow -> FMAX."""
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), tl.minimum(x, FMAX))
    return tl.minimum(x / T, FMAX)


@triton.jit
def is_kept(d, e, minp, cut):
    return (d > float("-inf")) & (e >= minp) & (d >= cut)


@triton.jit
def pick(vec, idx, at):
    """vec[at] as a scalar (idx: vec's positions)."""
    return tl.sum(tl.where(idx == at, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def probe_values(a, b, j, NP: tl.constexpr):
    """NP values splitting [a, b] evenly, the last b itself."""
    t = a + (b - a) * (j + 1).to(tl.float32) / NP
    return tl.where(j == NP - 1, b, t)


@triton.jit
def pass_sums(base, start, end, V, T, top, minp, cut, lo, hi, t, BY_COUNT: tl.constexpr, SB: tl.constexpr,
              NP: tl.constexpr):
    """Over entries [start, end) kept and in the bracket [lo, hi): per probe t_j the count (and, not BY_COUNT, the
    mass) at or above it, the smallest there and the largest below it; and the bracket's count, mass, smallest and
    largest. Per-lane partials, reduced once: a reduction across the program costs a barrier."""
    n_ge = tl.zeros((SB, NP), tl.int32)  # kept entries in [t_j, hi)
    m_ge = tl.zeros((SB, NP), tl.float64)
    min_ge = tl.full((SB, NP), float("inf"), tl.float32)  # the smallest in [t_j, hi)
    max_lt = tl.full((SB, NP), -float("inf"), tl.float32)  # the largest in [lo, t_j)
    n_in = tl.zeros((SB,), tl.int32)
    m_in = tl.zeros((SB,), tl.float64)
    min_in = tl.full((SB,), float("inf"), tl.float32)
    max_in = tl.full((SB,), -float("inf"), tl.float32)
    for off in range(start, end, SB):
        cols = off + tl.arange(0, SB)
        d = scaled(base, cols, V, T) - top
        e = tl.exp(d)
        take = is_kept(d, e, minp, cut) & (d >= lo) & (d < hi) & (cols < end)
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
    return (tl.sum(n_ge, axis=0), tl.sum(m_ge, axis=0), tl.min(min_ge, axis=0), tl.max(max_lt, axis=0),
            tl.sum(n_in, axis=0), tl.sum(m_in, axis=0), tl.min(min_in, axis=0), tl.max(max_in, axis=0))


@triton.jit
def narrow(t, j, lo, hi, above_n, above_m, target, known, k, p, n_ge, m_ge, min_ge, max_lt, n_in, m_in, min_in,
           max_in, BY_COUNT: tl.constexpr, NP: tl.constexpr):
    """A search pass's sums (pass_sums over the whole row) -> the probe interval that holds the answer v, the
    smallest value whose statistic (count / mass) at or above any value past it is below the target (a probe t with
    stat(>= t) < target has v < t, else v >= t): (lo, hi, above_n, above_m, inside, target, a, b, done, answer),
    [a, b] the exact extremes of the kept entries in the new [lo, hi), inside their count. The first pass (not
    known) sets the target from the whole kept set: k, or p x its mass. done: the answer is known (fewer kept
    than k: -inf; the two sides' sums rounded across the target: lo)."""
    fewer = False  # than k kept: nothing to cut
    if not known:
        if BY_COUNT:
            target = k.to(tl.float64)
            fewer = n_in < k
        else:
            target = p.to(tl.float64) * m_in
    if BY_COUNT:
        stat = above_n + n_ge
    else:
        stat = above_m + m_ge
    done = fewer
    answer = -float("inf") + 0.0 * max_in  # float32
    a = min_in
    b = max_in
    inside = n_in
    if not fewer:
        first = tl.min(tl.where(stat.to(tl.float64) < target, j, NP), axis=0)  # v lies below t[first]
        if first == 0:
            new_lo = lo
            n_lo = n_in
            a = min_in
        else:
            new_lo = pick(t, j, first - 1)
            n_lo = pick(n_ge, j, first - 1)
            a = pick(min_ge, j, first - 1)
        if first < NP:
            hi = pick(t, j, first)
            n_hi = pick(n_ge, j, first)
            above_n += n_hi
            if not BY_COUNT:
                above_m += pick(m_ge, j, first)
            b = pick(max_lt, j, first)
        else:
            n_hi = 0
            b = max_in
        lo = new_lo
        inside = n_lo - n_hi
        if inside <= 0:  # the two sides' sums rounded across the target: any cut in [lo, hi) is theirs
            answer = lo
            done = True
    return lo, hi, above_n, above_m, inside, target, a, b, done, answer


@triton.jit
def resolve(vals, c, n, k, above_n, above_m, target, BY_COUNT: tl.constexpr):
    """The answer from the bracket's n entries sorted descending (vals, positions c; -inf past n)."""
    if BY_COUNT:
        at = tl.minimum(tl.maximum(k - above_n - 1, 0), n - 1)
    else:
        w = tl.where(c < n, tl.exp(vals), 0.0).to(tl.float64)
        before = above_m + tl.cumsum(w, axis=0) - w
        at = tl.maximum(tl.sum(((before < target) & (c < n)).to(tl.int32), axis=0) - 1, 0)
    return pick(vals, c, at)


@triton.jit
def _cut(base, V, T, top, minp, cut, k, p, a, b, gathered,
         BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
         MAX_PASSES: tl.constexpr):
    """top-k's k-th largest kept d (BY_COUNT; -inf where fewer than k are kept) or top-p's cut (the smallest kept d
    whose kept mass strictly above it is below p x the kept mass), over entries kept by min_p and >= cut, in one
    program. [a, b]: where to probe first."""
    none = tl.zeros((), tl.int32)  # typed: the search's loop carries these
    return cut_from(base, V, T, top, minp, cut, k, p, -float("inf") + 0.0 * a, float("inf") + 0.0 * a, none,
                    tl.zeros((), tl.float64), none, tl.zeros((), tl.float64), none != 0, a, b, gathered,
                    BY_COUNT, BLOCK, SB, NP, CAP, MAX_PASSES)


@triton.jit
def cut_from(base, V, T, top, minp, cut, k, p, lo, hi, above_n, above_m, inside, target, known, a, b, gathered,
             BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
             MAX_PASSES: tl.constexpr):
    """_cut's search from a state narrow left (known) or from the start: passes until the bracket holds one
    value or at most CAP entries, which are gathered, sorted and resolved."""
    j = tl.arange(0, NP)
    done = False
    answer = -float("inf") + 0.0 * a
    passes = 0
    while not done:
        if known & (inside <= CAP):
            n = 0
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                d = scaled(base, cols, V, T) - top
                e = tl.exp(d)
                take = is_kept(d, e, minp, cut) & (d >= lo) & (d < hi)
                slot = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(gathered + slot, d, mask=take & (slot < CAP))
                n += tl.sum(take.to(tl.int32), axis=0)
            tl.debug_barrier()  # the stores above, read back by the whole program
            c = tl.arange(0, CAP)
            vals = tl.sort(tl.load(gathered + c, mask=c < n, other=-float("inf")), descending=True)
            answer = resolve(vals, c, n, k, above_n, above_m, target, BY_COUNT)
            done = True
        elif known & (a == b):
            answer = a  # one value left in the bracket
            done = True
        else:
            t = probe_values(a, b, j, NP)
            n_ge, m_ge, min_ge, max_lt, n_in, m_in, min_in, max_in = pass_sums(
                base, 0, V, V, T, top, minp, cut, lo, hi, t, BY_COUNT, SB, NP)
            lo, hi, above_n, above_m, inside, target, a, b, done, answer = narrow(
                t, j, lo, hi, above_n, above_m, target, known, k, p, n_ge, m_ge, min_ge, max_lt, n_in, m_in,
                min_in, max_in, BY_COUNT, NP)
            known = True
        passes += 1
        if passes >= MAX_PASSES:
            answer = a
            done = True
    return answer


@triton.jit
def kept_mass(base, start, end, V, T, top, minp, cut, BLOCK: tl.constexpr):
    """The kept mass of entries [start, end), float64."""
    total = tl.zeros((), tl.float64)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        d = scaled(base, cols, V, T) - top
        e = tl.exp(d)
        total += tl.sum(tl.where(is_kept(d, e, minp, cut) & (cols < end), e, 0.0).to(tl.float64), axis=0)
    return total


@triton.jit
def token_in(base, start, end, V, T, top, minp, cut, before, goal, BLOCK: tl.constexpr):
    """The first kept token in [start, end) whose kept mass from `before` on passes goal (the last kept one where
    none does: a goal rounded up to the total)."""
    token = 2147483647
    last = -1
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        d = scaled(base, cols, V, T) - top
        e = tl.exp(d)
        kept = is_kept(d, e, minp, cut) & (cols < end)
        w = tl.where(kept, e, 0.0).to(tl.float64)
        running = before + tl.cumsum(w, axis=0)
        token = tl.minimum(token, tl.min(tl.where(kept & (running > goal), cols, 2147483647), axis=0))
        last = tl.maximum(last, tl.max(tl.where(kept, cols, -1), axis=0))
        before += tl.sum(w, axis=0)
    return tl.where(token == 2147483647, last, token)


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
        y = scaled(base, off + tl.arange(0, BLOCK), V, T)
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
            s = kept_mass(base, i * BLOCK, i * BLOCK + BLOCK, V, T, top, minp, cut, BLOCK)
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
        before = pick(through - block_sums, bi, chosen)
        token = token_in(base, chosen * BLOCK, chosen * BLOCK + BLOCK, V, T, top, minp, cut, before, goal, BLOCK)
    tl.store(out_ptr + r, token.to(tl.int64))
    tl.store(cuts_ptr + r, cut)


def per_row(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
        logits, logits.stride(0), V, per_row(rows, torch.long), per_row(temperature, torch.float32),
        per_row(top_k if top_k is not None else rows, torch.long),
        per_row(top_p if top_p is not None else temperature, torch.float32),
        per_row(min_p if min_p is not None else temperature, torch.float32), per_row(u, torch.float64), out, cuts,
        gathered, sums,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None, BLOCK=block,
        SB=search_block, NP=probes, CAP=cap, NBLOCKS=nblocks, MAX_PASSES=MAX_PASSES, num_warps=num_warps)
    return out
