"""Prefill MoE with many rows per expert: the routed experts unpacked to bf16 once per call, then torch's
grouped GEMM (CUTLASS on sm90) over the (token, expert) pairs sorted by expert. Same signature and
arithmetic as kernels.reference.moe_experts (bf16 GEMM outputs, the clamped SwiGLU, the routing weight
on the down projection's output), so it is the reference's result up to summation order. Experts whose
unpacked weights exceed the scratch bound go through in chunks of experts (moe_experts_grouped).

Why: the fused MoE (kernels/fused_moe.py) decodes every weight tile inside its GEMM, which bounds it well
under the tensor cores' rate at prefill (27% of peak at 2048 tokens: tools/bench_moe_prefill.py,
docs/perf/h200-2026-12-03-s10/moe_prefill.json); unpacking costs one pass over the experts' bytes (write 2 bytes
per weight), which pays once an expert has enough rows (quant_configs.moe_grouped says when).

Steps, all on the device without a host sync (CUDA-graph capturable): the alignment kernel's pairs grouped
by expert and each expert's end offset (kernels/fused_moe_align.py); the pairs' rows gathered; gate and up
as two grouped GEMMs; the SwiGLU; down; then one kernel that sums each token's k rows times their routing
weights in float32 (pairs of index -1, another rank's experts, sort past the last expert's end: no GEMM
computes them and the sum skips them)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import quant_configs
from kernels.activations import clamped_swiglu
from kernels.deepseek_v41.fused import clamped_swiglu_fused
from kernels.fp8_unpack import fp8_unpacked
from kernels.fused_moe_align import moe_align_fused
from kernels.mxfp4_unpack import mxfp4_unpacked


def experts_unpacked(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored experts [E, N, K(/2)] -> [E, N, K] in `dtype` (bf16 for the grouped GEMM)."""
    if scale is None:
        return w if w.dtype == dtype else w.to(dtype)
    if w.dtype == torch.int8:
        return mxfp4_unpacked(w, scale).to(dtype)
    E, N, K = w.shape
    return fp8_unpacked(w.reshape(E * N, K), scale.reshape(-1, scale.shape[-1]), dtype).view(E, N, K)


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [P, K] rows grouped by expert, w [E, N, K], ends int32 [E] (expert e's rows end there; rows past
    the last end are not computed) -> [P, N]. torch's grouped GEMM on CUDA; elsewhere one GEMM per expert
    (CPU tests: the host reads the ends)."""
    if a.is_cuda:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = torch.nn.functional.linear(a[start:end], w[e])
        start = end
    return out


@triton.jit(do_not_specialize=["T"])
def _weighted_sum_kernel(y_ptr, pos_ptr, idx_ptr, rw_ptr, out_ptr, T, D, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over j of rw[t, j] * y[pos[t * TOPK + j]] in float32, in j order (deterministic)."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(TOPK):
        p = t * TOPK + j
        e = tl.load(idx_ptr + p)
        row = tl.load(pos_ptr + p).to(tl.int64)
        w = tl.load(rw_ptr + p).to(tl.float32)
        acc += w * tl.load(y_ptr + row * D + d, mask=mask & (d * 0 + e >= 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def experts_per_chunk(E: int, I: int, D: int, max_bytes: int) -> int:
    """How many experts' unpacked weights (bf16 [I, D] each, one weight at a time) fit the scratch bound."""
    return max(1, min(E, max_bytes // (I * D * 2)))


def _experts_mlp(rows, w1, w3, w2, scales, ends, limit, swiglu=None):
    """rows [P, D] grouped by expert (ends: each expert's end) through experts w1 / w3 / w2 as stored, each
    weight unpacked just before its GEMM -> [P, D] (rows past the last end: not computed). swiglu(gate, up) -> h:
    the activation over the rows that count (default: every row)."""
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    gate = grouped_mm(rows, experts_unpacked(w1, s1, rows.dtype), ends)
    up = grouped_mm(rows, experts_unpacked(w3, s3, rows.dtype), ends)
    h = swiglu(gate, up) if swiglu else clamped_swiglu_fused(gate, up, limit, out_dtype=rows.dtype)
    return grouped_mm(h, experts_unpacked(w2, s2, rows.dtype), ends)


@triton.jit
def _chunk_span(end_ptr, E0, E1):
    """(start, rows) of the chunk of experts [E0, E1) in the sorted pairs: expert E0 - 1's end (0 for the first) and
    the pairs up to expert E1 - 1's end, read on the device."""
    start = tl.load(end_ptr + E0 - 1, mask=E0 > 0, other=0)
    return start, tl.load(end_ptr + E1 - 1) - start


@triton.jit(do_not_specialize=["D"])
def _chunk_rows_kernel(src_ptr, dst_ptr, token_ptr, end_ptr, E0, E1, D, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the chunk of experts [E0, E1) (_chunk_span): GATHER, dst[r] = src[token_ptr[start + r]] (the
    chunk's rows from row 0); else dst[start + r] = src[r] (its outputs to their sorted rows). Programs past the
    chunk's rows return at once: the grid covers every pair, the device alone knows how many are the chunk's."""
    r = tl.program_id(0)
    start, rows = _chunk_span(end_ptr, E0, E1)
    if r >= rows:
        return
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    if GATHER:
        row = tl.load(token_ptr + start + r).to(tl.int64)
        tl.store(dst_ptr + r.to(tl.int64) * D + d, tl.load(src_ptr + row * D + d, mask=m), mask=m)
    else:
        tl.store(dst_ptr + (start + r).to(tl.int64) * D + d, tl.load(src_ptr + r.to(tl.int64) * D + d, mask=m),
                 mask=m)


@triton.jit(do_not_specialize=["I"])
def _chunk_swiglu_kernel(gate_ptr, up_ptr, h_ptr, end_ptr, E0, E1, I, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """h[r] = the SwiGLU of (gate[r], up[r]) for the chunk's rows r (_chunk_span) only."""
    r = tl.program_id(0)
    _, rows = _chunk_span(end_ptr, E0, E1)
    if r >= rows:
        return
    i = r.to(tl.int64) * I + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK) < I
    h = clamped_swiglu(tl.load(gate_ptr + i, mask=m).to(tl.float32), tl.load(up_ptr + i, mask=m).to(tl.float32),
                       limit, CLAMP)
    tl.store(h_ptr + i, h.to(h_ptr.dtype.element_ty), mask=m)


def _chunk_swiglu(gate, up, end, e0: int, e1: int, limit: float):
    h = torch.empty_like(gate)
    P, I = gate.shape
    _chunk_swiglu_kernel[(P, triton.cdiv(I, 1024))](gate, up, h, end, e0, e1, I, float(limit), CLAMP=limit > 0,
                                                    BLOCK=1024)
    return h


def moe_experts_grouped(x, w1, w3, w2, weights, indices, limit, scales=None, max_bytes: int | None = None):
    """kernels.reference.moe_experts' signature: x [T, D], w1/w3 [E, I, D(/2)], w2 [E, D, I(/2)] as stored,
    weights / indices [T, k]. max_bytes (default quant_configs.MOE_GROUPED_MAX_BYTES): the most one unpacked
    weight may take; more experts than fit go through in chunks that each fit (the rows of a chunk's experts
    gathered from an offset the device reads: no host sync), so any expert count runs in bounded scratch."""
    T, D = x.shape
    E, I = w1.shape[:2]
    k = indices.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    n_pairs = T * k
    if n_pairs == 0:
        return out
    idx = indices.reshape(-1).contiguous()
    sorted_ids, expert_end, _, _ = moe_align_fused(idx, E, 16)  # only the order and the ends are used
    token_of = torch.div(sorted_ids, k, rounding_mode="floor")
    bound = quant_configs.MOE_GROUPED_MAX_BYTES if max_bytes is None else max_bytes
    chunk = E if scales is None else experts_per_chunk(E, I, D, bound)  # bf16 experts are read as stored: no scratch
    if chunk == E:
        y = _experts_mlp(x.index_select(0, token_of), w1, w3, w2, scales, expert_end, limit)
    else:
        # a chunk's experts own the sorted rows [start, end): gathered to row 0 of a buffer of all the pairs' size,
        # so the grouped GEMMs' offsets are the chunk's ends less start, and their outputs copied back to the rows
        y = torch.empty(n_pairs, D, dtype=x.dtype, device=x.device)
        rows = torch.empty(n_pairs, D, dtype=x.dtype, device=x.device)
        grid = (n_pairs, triton.cdiv(D, 1024))
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            _chunk_rows_kernel[grid](x, rows, token_of, expert_end, e0, e1, D, GATHER=True, BLOCK=1024)
            ends = expert_end[e0:e1] - (expert_end[e0 - 1] if e0 else 0)
            sc = tuple(s[e0:e1] for s in scales) if scales is not None else None
            y_c = _experts_mlp(rows, w1[e0:e1], w3[e0:e1], w2[e0:e1], sc, ends, limit,
                               functools.partial(_chunk_swiglu, end=expert_end, e0=e0, e1=e1, limit=limit))
            _chunk_rows_kernel[grid](y_c, y, token_of, expert_end, e0, e1, D, GATHER=False, BLOCK=1024)
    pos = torch.empty_like(sorted_ids)  # each pair's row in the sorted order
    pos.scatter_(0, sorted_ids.long(), torch.arange(n_pairs, dtype=pos.dtype, device=x.device))
    rw = weights.reshape(-1).contiguous()
    _weighted_sum_kernel[(T, triton.cdiv(D, 1024))](y, pos, idx, rw, out, T, D, TOPK=k, BLOCK=1024)
    return out
