"""Sampled rows' tokens, each row spread over many programs: kernels.reference.sample_draw as kernels/fused_draw.py
computes it, and K.sample_draw's kernel at every batch.

One program a row reads its 129,280 entries on one multiprocessor: with top-p that measured slower than torch's sort
at one row and no better than 2.8x it at 150. Here each row is cut into segments of SEGMENT entries, one program a
segment, and the steps that need the whole row are launches of one program a row that combine the segments' sums
from the launch before (state in a small per-row buffer, so every launch count is fixed and a CUDA graph holds them).
Measured (kernels_sample_draw, CUDA-graph replays, H100, 2026-12-07, docs/perf/h100-2026-12-07d/): top-p 0.95 at
1 / 32 / 150 rows 0.101 / 0.200 / 0.836 ms against one program a row's 0.692 / 0.702 / 1.645 and torch's 0.214 /
1.335 / 4.601; faster than both for every option and batch measured. The launches:
  segments: largest and smallest y           -> row: the row's, top-k's search set up
  PASSES x (segments: a search pass's sums   -> row: the bracket narrowed, fused_draw.narrow)
  segments: the bracket's entries gathered   -> row: sorted and resolved; top-p's search set up
  (top-p the same)
  segments: kept mass                        -> row: the segment, then the token, where u x the total falls.
A launch with nothing left to do (a search resolved in fewer passes, a row without the option) returns at once; a
search still open after PASSES passes finishes in its row program (fused_draw.cut_from), so every input gets the
one-program kernel's answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_draw import (
    FMAX,
    MAX_PASSES,
    cut_from,
    is_kept,
    kept_mass,
    narrow,
    pass_sums,
    per_row,
    pick,
    probe_values,
    resolve,
    scaled,
    token_in,
)

SEGMENT = 4096  # entries a segment program reads (129,280 entries: 32 programs a row)
SEARCH_BLOCK = 128
NP = 16  # probes a pass tests: the bracket narrows ~17-fold a pass
PASSES = 3  # search passes launched a search; most rows' brackets hold <= CAP entries after 2
CAP = 2048
BLOCK = 1024  # entries the row programs' scans and the segments' sums read at a time
NUM_WARPS = 4

# the per-row state, float64 (integers and float32 values held exactly): its fields' places
TOP, LOW, CUT, LO, HI, ABOVE_N, ABOVE_M, INSIDE, TARGET, KNOWN, A, B, ACTIVE, K, P, MINP = (tl.constexpr(i)
                                                                                         for i in range(16))
STATE = tl.constexpr(16)


@triton.jit
def _row(x_ptr, stride, rows_ptr, temp_ptr, r):
    base = x_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
    return base, tl.load(temp_ptr + r)


@triton.jit
def _open(st):
    """A search's state from the row's buffer: (active, known, inside, a, b)."""
    active = tl.load(st + ACTIVE) != 0
    known = tl.load(st + KNOWN) != 0
    inside = tl.load(st + INSIDE).to(tl.int32)
    a = tl.load(st + A).to(tl.float32)
    b = tl.load(st + B).to(tl.float32)
    return active, known, inside, a, b


@triton.jit
def _probing(active, known, inside, a, b, CAP: tl.constexpr):
    """Whether a search pass is still needed (_open's state): the search active and its bracket neither one value nor
    small enough to gather."""
    return active & ~(known & ((inside <= CAP) | (a == b)))


@triton.jit
def _seg_extremes_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, part_ptr, S, SEGMENT: tl.constexpr,
                         BLOCK: tl.constexpr):
    r, s = tl.program_id(0), tl.program_id(1)
    base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
    top = tl.full((BLOCK,), -float("inf"), tl.float32)
    low = tl.full((BLOCK,), float("inf"), tl.float32)
    for off in range(s * SEGMENT, s * SEGMENT + SEGMENT, BLOCK):
        y = scaled(base, off + tl.arange(0, BLOCK), V, T)
        top = tl.maximum(top, y)
        low = tl.minimum(low, tl.where(y > float("-inf"), y, float("inf")))
    out = part_ptr + (r * S + s) * 2
    tl.store(out, tl.max(top, axis=0))
    tl.store(out + 1, tl.min(low, axis=0))


@triton.jit
def _start(st, V, first_a, BY_COUNT: tl.constexpr, ON: tl.constexpr):
    """Set up a search (ON: the option is on for the batch): active where the row's option cuts anything."""
    top = tl.load(st + TOP).to(tl.float32)
    active = ON & (top > float("-inf"))
    a = first_a
    if BY_COUNT:
        active = active & (tl.load(st + K) < V)
    else:
        p = tl.load(st + P)
        active = active & (p < 1.0)
        # top-p's cut lies where the entries below it weigh 1 - p at most: above -log(V / (1 - p)) in d
        a = tl.maximum(a, (-tl.log(V / (1.0 - p)) - 1.0).to(tl.float32))
    tl.store(st + ACTIVE, active.to(tl.float64))
    tl.store(st + LO, -float("inf"))
    tl.store(st + HI, float("inf"))
    tl.store(st + ABOVE_N, 0.0)
    tl.store(st + ABOVE_M, 0.0)
    tl.store(st + INSIDE, 0.0)
    tl.store(st + TARGET, 0.0)
    tl.store(st + KNOWN, 0.0)
    tl.store(st + A, a.to(tl.float64))
    tl.store(st + B, 0.0)


@triton.jit
def _row_start_kernel(part_ptr, state_ptr, count_ptr, topk_ptr, topp_ptr, minp_ptr, V, S, SP: tl.constexpr,
                      HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """The row's extremes from its segments', its options into the state, the first search set up."""
    r = tl.program_id(0)
    si = tl.arange(0, SP)
    part = part_ptr + (r * S + si) * 2
    top = tl.max(tl.load(part, mask=si < S, other=-float("inf")), axis=0)
    low = tl.min(tl.load(part + 1, mask=si < S, other=float("inf")), axis=0)
    st = state_ptr + r * STATE
    tl.store(st + TOP, top.to(tl.float64))
    tl.store(st + LOW, low.to(tl.float64))
    tl.store(st + CUT, -float("inf"))
    k = tl.full((), V, tl.float64)  # off unless asked: every field a later launch loads is written
    if HAS_TOP_K:
        k = tl.load(topk_ptr + r).to(tl.float64)
    tl.store(st + K, k)
    p = tl.full((), 1.0, tl.float64)
    if HAS_TOP_P:
        p = tl.load(topp_ptr + r).to(tl.float64)
    tl.store(st + P, p)
    minp = 0.0
    if HAS_MIN_P:
        minp = tl.load(minp_ptr + r)
    tl.store(st + MINP, minp.to(tl.float64))
    tl.store(count_ptr + r, 0)
    first_a = tl.maximum(low - top, -FMAX)
    if HAS_TOP_K:
        _start(st, V, first_a, True, True)
    else:
        _start(st, V, first_a, False, HAS_TOP_P)


@triton.jit
def _seg_pass_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, state_ptr, sums_ptr, S, BY_COUNT: tl.constexpr,
                     SEGMENT: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr):
    """A search pass's sums over one segment (fused_draw.pass_sums): [r, s, 8, NP], the bracket's at lane 0."""
    r, s = tl.program_id(0), tl.program_id(1)
    st = state_ptr + r * STATE
    active, known, inside, a, b = _open(st)
    if _probing(active, known, inside, a, b, CAP):
        base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
        j = tl.arange(0, NP)
        t = probe_values(a, b, j, NP)
        top = tl.load(st + TOP).to(tl.float32)
        cut = tl.load(st + CUT).to(tl.float32)
        minp = tl.load(st + MINP).to(tl.float32)
        lo = tl.load(st + LO).to(tl.float32)
        hi = tl.load(st + HI).to(tl.float32)
        n_ge, m_ge, min_ge, max_lt, n_in, m_in, min_in, max_in = pass_sums(
            base, s * SEGMENT, tl.minimum(s * SEGMENT + SEGMENT, V), V, T, top, minp, cut, lo, hi, t, BY_COUNT, SB, NP)
        out = sums_ptr + (r * S + s) * 8 * NP
        first = j == 0
        tl.store(out + j, n_ge.to(tl.float64))
        tl.store(out + NP + j, m_ge)
        tl.store(out + 2 * NP + j, min_ge.to(tl.float64))
        tl.store(out + 3 * NP + j, max_lt.to(tl.float64))
        tl.store(out + 4 * NP + j, n_in.to(tl.float64), mask=first)
        tl.store(out + 5 * NP + j, m_in, mask=first)
        tl.store(out + 6 * NP + j, min_in.to(tl.float64), mask=first)
        tl.store(out + 7 * NP + j, max_in.to(tl.float64), mask=first)


@triton.jit
def _row_narrow_kernel(state_ptr, sums_ptr, S, BY_COUNT: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr,
                       CAP: tl.constexpr):
    """The segments' sums of a pass added up and the bracket narrowed (fused_draw.narrow); a search it resolves
    moves the cut."""
    r = tl.program_id(0)
    st = state_ptr + r * STATE
    j = tl.arange(0, NP)
    active, known, inside, a, b = _open(st)
    if _probing(active, known, inside, a, b, CAP):
        si = tl.arange(0, SP)
        seg = sums_ptr + (r * S + si[:, None]) * 8 * NP + j[None, :]
        ok = (si < S)[:, None] & (j >= 0)[None, :]
        n_ge = tl.sum(tl.load(seg, mask=ok, other=0.0), axis=0).to(tl.int32)
        m_ge = tl.sum(tl.load(seg + NP, mask=ok, other=0.0), axis=0)
        min_ge = tl.min(tl.load(seg + 2 * NP, mask=ok, other=float("inf")), axis=0).to(tl.float32)
        max_lt = tl.max(tl.load(seg + 3 * NP, mask=ok, other=-float("inf")), axis=0).to(tl.float32)
        lane0 = sums_ptr + (r * S + si) * 8 * NP
        n_in = tl.sum(tl.load(lane0 + 4 * NP, mask=si < S, other=0.0), axis=0).to(tl.int32)
        m_in = tl.sum(tl.load(lane0 + 5 * NP, mask=si < S, other=0.0), axis=0)
        min_in = tl.min(tl.load(lane0 + 6 * NP, mask=si < S, other=float("inf")), axis=0).to(tl.float32)
        max_in = tl.max(tl.load(lane0 + 7 * NP, mask=si < S, other=-float("inf")), axis=0).to(tl.float32)
        t = probe_values(a, b, j, NP)
        k = tl.load(st + K).to(tl.int32)
        p = tl.load(st + P).to(tl.float32)
        lo, hi, above_n, above_m, inside, target, a, b, done, answer = narrow(
            t, j, tl.load(st + LO).to(tl.float32), tl.load(st + HI).to(tl.float32),
            tl.load(st + ABOVE_N).to(tl.int32), tl.load(st + ABOVE_M), tl.load(st + TARGET), known, k, p,
            n_ge, m_ge, min_ge, max_lt, n_in, m_in, min_in, max_in, BY_COUNT, NP)
        if done:
            tl.store(st + CUT, tl.maximum(tl.load(st + CUT), answer.to(tl.float64)))
            tl.store(st + ACTIVE, 0.0)
        else:
            tl.store(st + LO, lo.to(tl.float64))
            tl.store(st + HI, hi.to(tl.float64))
            tl.store(st + ABOVE_N, above_n.to(tl.float64))
            tl.store(st + ABOVE_M, above_m)
            tl.store(st + INSIDE, inside.to(tl.float64))
            tl.store(st + TARGET, target)
            tl.store(st + KNOWN, 1.0)
            tl.store(st + A, a.to(tl.float64))
            tl.store(st + B, b.to(tl.float64))


@triton.jit
def _seg_gather_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, state_ptr, count_ptr, gathered_ptr,
                       SEGMENT: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """A segment's entries in a bracket of at most CAP, appended to the row's list (slots reserved atomically:
    the list's order does not matter, the row program sorts it)."""
    r, s = tl.program_id(0), tl.program_id(1)
    st = state_ptr + r * STATE
    active, known, inside, a, b = _open(st)
    if active & known & (inside <= CAP) & (a != b):
        base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
        top = tl.load(st + TOP).to(tl.float32)
        cut = tl.load(st + CUT).to(tl.float32)
        minp = tl.load(st + MINP).to(tl.float32)
        lo = tl.load(st + LO).to(tl.float32)
        hi = tl.load(st + HI).to(tl.float32)
        end = tl.minimum(s * SEGMENT + SEGMENT, V)
        for off in range(s * SEGMENT, s * SEGMENT + SEGMENT, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            d = scaled(base, cols, V, T) - top
            e = tl.exp(d)
            take = is_kept(d, e, minp, cut) & (d >= lo) & (d < hi) & (cols < end)
            n = tl.sum(take.to(tl.int32), axis=0)
            if n > 0:
                first = tl.atomic_add(count_ptr + r, n)
                slot = first + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(gathered_ptr + r.to(tl.int64) * CAP + slot, d, mask=take & (slot < CAP))


@triton.jit
def _row_resolve_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, state_ptr, count_ptr, gathered_ptr, BY_COUNT: tl.constexpr,
                        NEXT_TOP_P: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr,
                        CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """A search's answer: the bracket's one value, its gathered entries sorted, or (still open after the launched
    passes) the rest of the search in this program; the cut moved, the counter cleared, top-p's search set up
    (NEXT_TOP_P)."""
    r = tl.program_id(0)
    st = state_ptr + r * STATE
    active, known, inside, a, b = _open(st)
    if active:
        k = tl.load(st + K).to(tl.int32)
        above_n = tl.load(st + ABOVE_N).to(tl.int32)
        above_m = tl.load(st + ABOVE_M)
        target = tl.load(st + TARGET)
        if known & (a == b):
            answer = a
        elif known & (inside <= CAP):
            c = tl.arange(0, CAP)
            n = tl.minimum(tl.load(count_ptr + r), CAP)
            vals = tl.sort(tl.load(gathered_ptr + r.to(tl.int64) * CAP + c, mask=c < n, other=-float("inf")),
                           descending=True)
            answer = resolve(vals, c, n, k, above_n, above_m, target, BY_COUNT)
        else:
            base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
            answer = cut_from(base, V, T, tl.load(st + TOP).to(tl.float32), tl.load(st + MINP).to(tl.float32),
                              tl.load(st + CUT).to(tl.float32), k, tl.load(st + P).to(tl.float32),
                              tl.load(st + LO).to(tl.float32), tl.load(st + HI).to(tl.float32), above_n, above_m,
                              inside, target, known, a, b, gathered_ptr + r.to(tl.int64) * CAP, BY_COUNT, BLOCK,
                              SB, NP, CAP, MAX_PASSES)
        tl.store(st + CUT, tl.maximum(tl.load(st + CUT), answer.to(tl.float64)))
    tl.store(count_ptr + r, 0)
    if NEXT_TOP_P:
        top = tl.load(st + TOP).to(tl.float32)
        _start(st, V, tl.maximum(tl.load(st + LOW).to(tl.float32) - top, -FMAX), False, True)
    else:
        tl.store(st + ACTIVE, 0.0)


@triton.jit
def _seg_mass_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, state_ptr, mass_ptr, S, SEGMENT: tl.constexpr,
                     BLOCK: tl.constexpr):
    r, s = tl.program_id(0), tl.program_id(1)
    st = state_ptr + r * STATE
    top = tl.load(st + TOP).to(tl.float32)
    mass = tl.zeros((), tl.float64)
    if top > float("-inf"):
        base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
        mass = kept_mass(base, s * SEGMENT, tl.minimum(s * SEGMENT + SEGMENT, V), V, T, top,
                          tl.load(st + MINP).to(tl.float32), tl.load(st + CUT).to(tl.float32), BLOCK)
    tl.store(mass_ptr + r * S + s, mass)


@triton.jit
def _row_locate_kernel(x_ptr, stride, V, rows_ptr, temp_ptr, state_ptr, mass_ptr, u_ptr, out_ptr, cuts_ptr, S,
                       SP: tl.constexpr, SEGMENT: tl.constexpr, BLOCK: tl.constexpr):
    """The segment, then the token, where the kept mass passes u x the total (fused_draw's last step)."""
    r = tl.program_id(0)
    st = state_ptr + r * STATE
    top = tl.load(st + TOP).to(tl.float32)
    cut = tl.load(st + CUT).to(tl.float32)
    token = -1
    if top > float("-inf"):
        base, T = _row(x_ptr, stride, rows_ptr, temp_ptr, r)
        si = tl.arange(0, SP)
        seg_mass = tl.load(mass_ptr + r * S + si, mask=si < S, other=0.0)
        through = tl.cumsum(seg_mass, axis=0)
        goal = tl.load(u_ptr + r).to(tl.float64) * tl.sum(seg_mass, axis=0)
        chosen = tl.sum((through <= goal).to(tl.int32), axis=0)
        chosen = tl.minimum(chosen, tl.max(tl.where(seg_mass > 0, si, 0), axis=0))  # a goal rounded up to the total
        before = pick(through - seg_mass, si, chosen)
        token = token_in(base, chosen * SEGMENT, tl.minimum(chosen * SEGMENT + SEGMENT, V), V, T, top,
                          tl.load(st + MINP).to(tl.float32), cut, before, goal, BLOCK)
    tl.store(out_ptr + r, token.to(tl.int64))
    tl.store(cuts_ptr + r, cut)


def sample_draw_wide(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                     u: torch.Tensor, cuts: torch.Tensor | None = None, segment: int = SEGMENT,
                     search_block: int = SEARCH_BLOCK, probes: int = NP, passes: int = PASSES, cap: int = CAP,
                     block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """kernels.reference.sample_draw as fused_draw.sample_draw_fused (the same arguments and answers), each row over
    cdiv(V, segment) programs; the sizes change the launches' shapes (tests walk every branch with small ones)."""
    w, V = rows.shape[0], logits.shape[-1]
    dev = logits.device
    out = torch.empty(w, dtype=torch.long, device=dev)
    if w == 0:
        return out
    if segment % block or segment % search_block:
        raise ValueError("segment must be a multiple of block and search_block")
    cuts = torch.empty(w, dtype=torch.float32, device=dev) if cuts is None else cuts
    S = triton.cdiv(V, segment)
    SP = triton.next_power_of_2(S)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    x = (logits, logits.stride(0), V, per_row(rows, torch.long), per_row(temperature, torch.float32))
    state = torch.empty(w, STATE.value, dtype=torch.float64, device=dev)
    count = torch.empty(w, dtype=torch.int32, device=dev)
    part = torch.empty(w, S, 2, dtype=torch.float32, device=dev)
    sums = torch.empty(w, S, 8, probes, dtype=torch.float64, device=dev)
    gathered = torch.empty(w, cap, dtype=torch.float32, device=dev)
    opts = {"num_warps": num_warps}
    _seg_extremes_kernel[(w, S)](*x, part, S, SEGMENT=segment, BLOCK=block, **opts)
    _row_start_kernel[(w,)](part, state, count, per_row(top_k if top_k is not None else rows, torch.long),
                            per_row(top_p if top_p is not None else temperature, torch.float32),
                            per_row(min_p if min_p is not None else temperature, torch.float32), V, S, SP=SP,
                            HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
                            **opts)
    searches = [s for s, on in ((True, top_k is not None), (False, top_p is not None)) if on]
    for by_count in searches:
        for _ in range(passes):
            _seg_pass_kernel[(w, S)](*x, state, sums, S, BY_COUNT=by_count, SEGMENT=segment, SB=search_block,
                                     NP=probes, CAP=cap, **opts)
            _row_narrow_kernel[(w,)](state, sums, S, BY_COUNT=by_count, SP=SP, NP=probes, CAP=cap, **opts)
        _seg_gather_kernel[(w, S)](*x, state, count, gathered, SEGMENT=segment, BLOCK=block, CAP=cap, **opts)
        _row_resolve_kernel[(w,)](*x, state, count, gathered, BY_COUNT=by_count,
                                  NEXT_TOP_P=by_count and top_p is not None, BLOCK=block, SB=search_block,
                                  NP=probes, CAP=cap, MAX_PASSES=MAX_PASSES, **opts)
    mass = torch.empty(w, S, dtype=torch.float64, device=dev)
    _seg_mass_kernel[(w, S)](*x, state, mass, S, SEGMENT=segment, BLOCK=block, **opts)
    _row_locate_kernel[(w,)](*x, state, mass, per_row(u, torch.float64), out, cuts, S, SP=SP, SEGMENT=segment,
                             BLOCK=block, **opts)
    return out
