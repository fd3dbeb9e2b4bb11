"""Prefill MoE with many rows per expert: the routed experts unpacked to bf16 once per call, then torch's
grouped GEMM (CUTLASS on sm90) over the (token, expert) pairs sorted by expert. Same signature and
arithmetic as kernels.reference.moe_experts (bf16 GEMM outputs, the clamped SwiGLU, the routing weight
on the down projection's output), so it is the reference's result up to summation order.

Why: the fused MoE (kernels/fused_moe.py) decodes every weight tile inside its GEMM, which bounds it well
under the tensor cores' rate at prefill (27% of peak at 2048 tokens: tools/bench_moe_prefill.py,
docs/perf/h200-2026-12-03-s10/moe_prefill.json); unpacking costs one pass over the experts' bytes (write 2 bytes
per weight), which pays once an expert has enough rows (quant_configs.moe_grouped says when, and caps the unpacked bytes).

Steps, all on the device without a host sync (CUDA-graph capturable): the alignment kernel's pairs grouped
by expert and each expert's end offset (kernels/fused_moe_align.py); the pairs' rows gathered; gate and up
as two grouped GEMMs; the SwiGLU; down; then one kernel that sums each token's k rows times their routing
weights in float32 (pairs of index -1, another rank's experts, sort past the last expert's end: no GEMM
computes them and the sum skips them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def moe_experts_grouped(x, w1, w3, w2, weights, indices, limit, scales=None):
    """kernels.reference.moe_experts' signature: x [T, D], w1/w3 [E, I, D(/2)], w2 [E, D, I(/2)] as stored,
    weights / indices [T, k]."""
    T, D = x.shape
    E = w1.shape[0]
    k = indices.shape[1]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    n_pairs = T * k
    if n_pairs == 0:
        return out
    idx = indices.reshape(-1).contiguous()
    sorted_ids, expert_end, _, _ = moe_align_fused(idx, E, 16)  # only the order and the ends are used
    rows = x.index_select(0, torch.div(sorted_ids, k, rounding_mode="floor"))
    gate = grouped_mm(rows, experts_unpacked(w1, s1, x.dtype), expert_end)
    up = grouped_mm(rows, experts_unpacked(w3, s3, x.dtype), expert_end)
    h = clamped_swiglu_fused(gate, up, limit, out_dtype=x.dtype)
    y = grouped_mm(h, experts_unpacked(w2, s2, x.dtype), expert_end)
    pos = torch.empty_like(sorted_ids)  # each pair's row in the sorted order
    pos.scatter_(0, sorted_ids.long(), torch.arange(n_pairs, dtype=pos.dtype, device=x.device))
    rw = weights.reshape(-1).contiguous()
    _weighted_sum_kernel[(T, triton.cdiv(D, 1024))](y, pos, idx, rw, out, T, D, TOPK=k, BLOCK=1024)
    return out
