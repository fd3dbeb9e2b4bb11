"""The MoE router gate. The engine dispatches router_topk_gemm_fused (cuBLAS GEMM, then one program
per token), measured faster on the H200; Mega-Gate (router_topk_fused) stays as the tested candidate.

Mega-Gate: the MoE router in one launch: gate GEMM, scores (V4's sqrt(softplus), or sigmoid /
softmax), the selection-only bias, top-k, renormalise and scale; hash-routed layers (tid2eid) take
their experts as given and only gather and renormalise their scores. Same signature as
kernels.reference.router_topk.

Grid (E tiles, token tiles): each program multiplies its tokens by BLOCK_E gate rows over all of D
(the 2 MB gate of V4-Flash is read once per token tile, by E / BLOCK_E programs at once) and stores
the logits, rounded to x's dtype as the reference's F.linear returns them; the last E tile of a
token tile to finish (kernels/semaphores.py) scores and selects for those tokens."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.bf16_gemv import bf16_gemv
from kernels.bf16_gemv import takes as bf16_gemv_takes
from kernels.fused_moe_align import CHUNK, align_outputs, align_pairs
from kernels.pdl import wait_and_release
from kernels.semaphores import semaphores

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
BLOCK_T, BLOCK_E, BLOCK_K = 16, 16, 256
ALIGN_CHUNK = tl.constexpr(CHUNK)  # the alignment's pairs per loop step (kernels/fused_moe_align.py)


@triton.jit
def _route_token(logits_ptr, bias_ptr, hash_ptr, w_ptr, idx_ptr, t, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                 SCORING: tl.constexpr, EP: tl.constexpr, HASH: tl.constexpr, VOLATILE: tl.constexpr,
                 span_lo=0, span_hi=0, SPAN: tl.constexpr = False):
    """Token t's row of logits [E] -> its k weights (stored in w_ptr's dtype, rounded as `.to` rounds) and expert
    ids. VOLATILE: the logits were stored by other programs of this launch (Mega-Gate), so read from L2, never a
    stale L1 line. SPAN: the ids as kernels.reference.local_experts gives them for [span_lo, span_hi) (expert
    parallel: this rank's experts counted from span_lo, -1 for another rank's)."""
    e = tl.arange(0, EP)
    m = e < E
    x = tl.load(logits_ptr + t * E + e, mask=m, other=0.0, volatile=VOLATILE).to(tl.float32)
    if SCORING == 0:  # sqrt(softplus(x)), softplus as torch computes it (linear above 20)
        s = tl.sqrt(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))
    elif SCORING == 1:
        s = tl.sigmoid(x)
    else:
        z = tl.exp(x - tl.max(tl.where(m, x, -float("inf")), axis=0))
        z = tl.where(m, z, 0.0)
        s = z / tl.sum(z, axis=0)
    kr = tl.arange(0, KP)
    if HASH:  # the frozen token -> experts table chose them
        ids = tl.load(hash_ptr + t * K + kr, mask=kr < K, other=0).to(tl.int64)
        ws = tl.sum(tl.where(e[None, :] == ids[:, None], s[None, :], 0.0), axis=1)
    else:
        sel = tl.where(m, s + tl.load(bias_ptr + e, mask=m, other=0.0), -float("inf"))
        ws = tl.zeros((KP,), tl.float32)
        ids = tl.zeros((KP,), tl.int64)
        for j in tl.static_range(K):  # k rounds of argmax: k is small (6 of 256 in V4)
            best = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == best, e, EP), axis=0)
            ws = tl.where(kr == j, tl.sum(tl.where(e == i, s, 0.0), axis=0), ws)
            ids = tl.where(kr == j, i.to(tl.int64), ids)
            sel = tl.where(e == i, -float("inf"), sel)
    ws = tl.where(kr < K, ws, 0.0)
    ws = ws / (tl.sum(ws, axis=0) + 1e-20) * scaling
    if SPAN:
        ids = tl.where((ids >= span_lo) & (ids < span_hi), ids - span_lo, -1)
    tl.store(w_ptr + t * K + kr, ws, mask=kr < K)
    tl.store(idx_ptr + t * K + kr, ids, mask=kr < K)


@triton.jit(do_not_specialize=["T", "max_blocks"])
def _gate_kernel(x_ptr, g_ptr, bias_ptr, hash_ptr, logits_ptr, sem_ptr, w_ptr, idx_ptr, T, D, E, scaling,
                 K: tl.constexpr, KP: tl.constexpr, SCORING: tl.constexpr, HASH: tl.constexpr, EP: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 work_ptr=None, sorted_ptr=None, expert_end_ptr=None, block_expert_ptr=None, block_start_ptr=None,
                 max_blocks=0, ALIGN_M: tl.constexpr = 0, ALIGN_EP: tl.constexpr = 1, span_lo=0, span_hi=0,
                 SPAN: tl.constexpr = False, PDL: tl.constexpr = False):
    """ALIGN_M > 0: the last token tile to be routed (a counter past the tiles' own) then aligns every pair
    (_router_kernel's). SPAN: local ids (_route_token's)."""
    wait_and_release(PDL)
    pid_e, pid_t = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask, emask = t < T, e < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < D
        x = tl.load(x_ptr + t[:, None] * D + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        g = tl.load(g_ptr + e[:, None] * D + k[None, :], mask=emask[:, None] & kmask[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(g.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(g.to(x.dtype)))
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # as F.linear rounds them
    tl.store(logits_ptr + t[:, None] * E + e[None, :], logits, mask=tmask[:, None] & emask[None, :])
    tl.debug_barrier()  # every thread's logits are stored before the counter's release
    if tl.atomic_add(sem_ptr + pid_t, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last E tile
        tl.atomic_xchg(sem_ptr + pid_t, 0)
        for i in range(0, BLOCK_T):
            tok = pid_t * BLOCK_T + i
            if tok < T:
                _route_token(logits_ptr, bias_ptr, hash_ptr, w_ptr, idx_ptr, tok, E, scaling, K, KP, SCORING, EP, HASH,
                             True, span_lo, span_hi, SPAN)
        if ALIGN_M > 0:
            _align_if_last(sem_ptr + tl.num_programs(1), tl.num_programs(1), idx_ptr, work_ptr, sorted_ptr,
                           expert_end_ptr, block_expert_ptr, block_start_ptr, T * K, E, max_blocks, ALIGN_M, ALIGN_EP)


@triton.jit
def _align_if_last(sem_ptr, arrivals, idx_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr, block_start_ptr,
                   n_pairs, E, max_blocks, ALIGN_M: tl.constexpr, ALIGN_EP: tl.constexpr):
    """The last of `arrivals` programs to arrive at the counter sem_ptr aligns the n_pairs ids at idx_ptr
    (kernels/fused_moe_align.py's one program) and zeroes the counter."""
    tl.debug_barrier()  # every thread's ids are stored before the counter's release
    if tl.atomic_add(sem_ptr, 1, sem="acq_rel") == arrivals - 1:
        tl.atomic_xchg(sem_ptr, 0)  # zero again (CUDA graphs replay it as is)
        align_pairs(idx_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr, block_start_ptr, n_pairs, E,
                    max_blocks, ALIGN_M, ALIGN_EP, ALIGN_CHUNK, True)


@triton.jit(do_not_specialize=["max_blocks"])  # grows with the batch
def _router_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                   SCORING: tl.constexpr, BLOCK_E: tl.constexpr, sem_ptr=None, work_ptr=None, sorted_ptr=None,
                   expert_end_ptr=None, block_expert_ptr=None, block_start_ptr=None, max_blocks=0,
                   ALIGN_M: tl.constexpr = 0, ALIGN_EP: tl.constexpr = 1, span_lo=0, span_hi=0,
                   SPAN: tl.constexpr = False, hash_ptr=None, HASH: tl.constexpr = False, PDL: tl.constexpr = False):
    """One token's route from the logits cuBLAS wrote before this launch (so plain loads). ALIGN_M > 0: the
    last program to finish (one counter at sem_ptr) then aligns every token's pairs into ALIGN_M-row tiles
    (kernels/fused_moe_align.py's one program), instead of the MoE's alignment launch. SPAN: local ids
    (_route_token's). HASH: a hash layer's experts given (hash_ptr [T, K]), their scores gathered."""
    wait_and_release(PDL)
    _route_token(logits_ptr, bias_ptr, hash_ptr, w_ptr, idx_ptr, tl.program_id(0), E, scaling, K, KP, SCORING, BLOCK_E,
                 HASH, False, span_lo, span_hi, SPAN)
    if ALIGN_M > 0:
        _align_if_last(sem_ptr, tl.num_programs(0), idx_ptr, work_ptr, sorted_ptr, expert_end_ptr, block_expert_ptr,
                       block_start_ptr, tl.num_programs(0) * K, E, max_blocks, ALIGN_M, ALIGN_EP)


def span_args(expert_span: tuple[int, int] | None, align_m: int | None = None) -> dict:
    """The routers' SPAN arguments: local ids for [lo, hi) (kernels.reference.local_experts), in the launch that
    routes (no elementwise launches after it); the alignment covers every gate row, so not with align_m."""
    if expert_span is None:
        return {}
    if align_m is not None:
        raise ValueError("the router aligns the pairs of every gate row: no expert_span with align_m")
    return {"span_lo": expert_span[0], "span_hi": expert_span[1], "SPAN": True}


def router_topk_gemm_fused(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids=None,
                           align_m: int | None = None, expert_span: tuple[int, int] | None = None):
    """The engine's router: the gate GEMM on cuBLAS, then one program per token for scores, bias,
    top-k and renormalisation. Faster than Mega-Gate on the H200 at every
    batch measured (tools/bench_fused.py's Mega-Gate rows and the depth profile, docs/perf/h200-2026-12-01-s5/).
    align_m (not for hash layers or a gate without bias): also the ids' MoE alignment into align_m-row tiles
    (kernels.fused_moe_align.moe_align_fused's four outputs, every gate row an expert), from the same launch:
    returns (weights, ids, alignment). expert_span: kernels.reference.router_topk's. The weights come out in x's
    dtype from the launch that routes (no cast launch after it). Hash layers (hash_ids: tid2eid's experts) gather
    and renormalise their scores in the same one program per token (not torch's seven launches)."""
    span = span_args(expert_span, align_m)
    hashed = hash_ids is not None
    if align_m is not None and (hashed or bias is None):
        raise ValueError("the router aligns the pairs only for a biased gate without a hash table")
    if bias is None and not hashed:
        from kernels.reference import router_topk
        return router_topk(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids, expert_span)
    # the gate GEMM (E x D, 2 MB at V4-Flash's 256 experts) at decode's rows: kernel variant bf16_gemv's one
    # PDL-aware launch where it takes it, else cuBLAS (a split-K GEMM and its reduce at one row)
    logits = (bf16_gemv(x, weight) if bf16_gemv_takes(x, weight) else torch.nn.functional.linear(x, weight)).contiguous()
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    route = (logits, logits if bias is None else bias.float().contiguous(), w, idx, E, routed_scaling)
    consts = {"K": top_k, "KP": triton.next_power_of_2(top_k), "SCORING": _SCORING[scoring_func],
              "BLOCK_E": triton.next_power_of_2(E), **span, **pdl.options(logits)}
    if hashed:
        consts.update(hash_ptr=hash_ids.contiguous(), HASH=True)
    if align_m is None:
        if T:
            _router_kernel[(T,)](*route, **consts)
        return w, idx
    layout, align = _alignment(T * top_k, E, align_m, x.device)
    if T:
        _router_kernel[(T,)](*route, sem_ptr=semaphores(x.device, 1), **align, **consts)
    return w, idx, layout


def _alignment(n_pairs: int, E: int, align_m: int, device) -> tuple[tuple, dict]:
    """The alignment's four outputs, and the router kernels' arguments that fill them."""
    work, sorted_ids, expert_end, block_expert, block_start = align_outputs(n_pairs, E, align_m, device)
    return (sorted_ids, expert_end, block_expert, block_start), {
        "work_ptr": work, "sorted_ptr": sorted_ids, "expert_end_ptr": expert_end, "block_expert_ptr": block_expert,
        "block_start_ptr": block_start, "max_blocks": block_expert.numel(), "ALIGN_M": align_m,
        "ALIGN_EP": triton.next_power_of_2(E + 1)}


def router_topk_fused(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids=None, align_m: int | None = None,
                      expert_span: tuple[int, int] | None = None):
    """Mega-Gate. align_m: also the ids' alignment, as router_topk_gemm_fused's, from the same launch (hash
    layers too): returns (weights, ids, alignment). expert_span and the weights' dtype: router_topk_gemm_fused's."""
    span = span_args(expert_span, align_m)
    if hash_ids is None and bias is None:
        if align_m is not None:
            raise ValueError("Mega-Gate aligns the pairs only for a biased gate or a hash table")
        from kernels.reference import router_topk  # a gate with neither bias nor table: the reference
        return router_topk(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids, expert_span)
    x = x if x.is_contiguous() else x.contiguous()
    T, D = x.shape
    E = weight.shape[0]
    w = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    layout, align = _alignment(T * top_k, E, align_m, x.device) if align_m is not None else (None, {})
    if T == 0:
        return (w, idx) if align_m is None else (w, idx, layout)
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(E, BLOCK_E), triton.cdiv(T, BLOCK_T))
    hashed = hash_ids is not None
    _gate_kernel[grid](x, weight, bias.float().contiguous() if bias is not None else logits,
                       hash_ids.contiguous() if hashed else idx, logits, semaphores(x.device, grid[1] + 1), w, idx,
                       T, D, E, routed_scaling, K=top_k, KP=triton.next_power_of_2(top_k),
                       SCORING=_SCORING[scoring_func], HASH=hashed, EP=triton.next_power_of_2(E), BLOCK_T=BLOCK_T,
                       BLOCK_E=BLOCK_E, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(D)),
                       DOT_F32=x.dtype == torch.float32 or _INTERPRET, **align, **span, **pdl.options(x))
    return (w, idx) if align_m is None else (w, idx, layout)
