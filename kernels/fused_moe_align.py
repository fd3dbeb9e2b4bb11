"""The fused MoE's row layout in one launch (was ~20 small torch ops): pair ids grouped by expert
and cut into BLOCK_M-row tiles per expert. Same outputs as kernels.reference.moe_align, except
that the order of the pairs inside one expert's run is whatever the atomics gave (each row's GEMM
result does not depend on its neighbours, so the MoE's output does not change). Pairs of index -1
(another rank's experts) are counted in a slot past the last expert: last in sorted_ids, in no tile.

One program: at decode the pairs are a few hundred and the work is latency; at prefill (tens of
thousands of pairs) it is a few microseconds of atomics against milliseconds of expert GEMMs.
Scratch (`work`, int32 [E + 1 + n_pairs]) holds the per-expert counters, then the run starts, and
each pair's rank within its expert; barriers order the phases inside the program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release

CHUNK = 1024  # pairs per step of the program's loops


@triton.jit(do_not_specialize=["n_pairs", "max_blocks"])
def _moe_align_kernel(ids_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr, block_start_ptr, n_pairs, E,
                      max_blocks, BLOCK_M: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr,
                      PDL: tl.constexpr = False):
    wait_and_release(PDL)
    align_pairs(ids_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr, block_start_ptr, n_pairs, E,
                max_blocks, BLOCK_M, EP, CH, False)


@triton.jit
def align_pairs(ids_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr, block_start_ptr, n_pairs, E,
                max_blocks, BLOCK_M: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr, VOLATILE: tl.constexpr):
    """The alignment by one program. VOLATILE: the expert ids were stored by other programs of the calling
    launch (the router's, kernels/fused_gate.py), so read from L2, never a stale L1 line."""
    e = tl.arange(0, EP)
    emask = e < E
    slots = e <= E  # the experts and the skipped pairs' slot E
    rank_ptr = work_ptr + E + 1
    tl.store(work_ptr + e, tl.zeros((EP,), tl.int32), mask=slots)
    tl.debug_barrier()
    for p0 in range(0, n_pairs, CH):  # rank of each pair within its expert; counts
        p = p0 + tl.arange(0, CH)
        m = p < n_pairs
        ex = tl.load(ids_ptr + p, mask=m, other=0, volatile=VOLATILE).to(tl.int32)
        ex = tl.where(ex < 0, E, ex)
        r = tl.atomic_add(work_ptr + ex, tl.full((CH,), 1, tl.int32), mask=m)
        tl.store(rank_ptr + p, r, mask=m)
    tl.debug_barrier()
    cnt = tl.load(work_ptr + e, mask=slots, other=0, volatile=True)
    end = tl.cumsum(cnt, 0)
    start = end - cnt
    tl.store(expert_end_ptr + e, end, mask=emask)
    tl.debug_barrier()
    tl.store(work_ptr + e, start, mask=slots)
    cnt = tl.where(emask, cnt, 0)  # tiles for the experts only
    tl.debug_barrier()
    for p0 in range(0, n_pairs, CH):  # scatter: sorted[start of its expert + rank] = pair
        p = p0 + tl.arange(0, CH)
        m = p < n_pairs
        ex = tl.load(ids_ptr + p, mask=m, other=0, volatile=VOLATILE).to(tl.int32)
        ex = tl.where(ex < 0, E, ex)
        s = tl.load(work_ptr + ex, mask=m, other=0, volatile=True)
        r = tl.load(rank_ptr + p, mask=m, other=0, volatile=True)
        tl.store(sorted_ptr + s + r, p, mask=m)
    n_blk = (cnt + BLOCK_M - 1) // BLOCK_M
    blk_start = tl.cumsum(n_blk, 0) - n_blk
    used = tl.sum(n_blk, axis=0)
    for b0 in range(0, max_blocks, CH):  # tiles past the used ones: -1
        b = b0 + tl.arange(0, CH)
        m = (b >= used) & (b < max_blocks)
        tl.store(block_expert_ptr + b, tl.full((CH,), -1, tl.int32), mask=m)
        tl.store(block_start_ptr + b, tl.zeros((CH,), tl.int32), mask=m)
    for j in range(0, tl.max(n_blk, axis=0)):  # tile j of every expert that has one
        m = emask & (j < n_blk)
        tl.store(block_expert_ptr + blk_start + j, e, mask=m)
        tl.store(block_start_ptr + blk_start + j, start + j * BLOCK_M, mask=m)


def align_outputs(n_pairs: int, num_experts: int, block_m: int, device) -> tuple:
    """(work, sorted_ids, expert_end, block_expert, block_start) for n_pairs pairs: the scratch, then the
    alignment's four outputs (moe_align_fused's return)."""
    max_blocks = triton.cdiv(n_pairs, block_m) + min(num_experts, n_pairs)
    i32 = {"dtype": torch.int32, "device": device}
    return (torch.empty(num_experts + 1 + n_pairs, **i32), torch.empty(n_pairs, **i32), torch.empty(num_experts, **i32),
            torch.empty(max_blocks, **i32), torch.empty(max_blocks, **i32))


def moe_align_fused(indices: torch.Tensor, num_experts: int, block_m: int):
    flat = indices.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n_pairs = flat.numel()
    work, *layout = align_outputs(n_pairs, num_experts, block_m, flat.device)
    _moe_align_kernel[(1,)](flat, work, *layout, n_pairs, num_experts, layout[2].numel(), BLOCK_M=block_m,
                            EP=triton.next_power_of_2(num_experts + 1), CH=CHUNK, num_warps=8, **pdl.options(flat))
    return tuple(layout)
