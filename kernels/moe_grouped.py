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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.deepseek_v41.fused import clamped_swiglu_fused
from kernels.fp8_unpack import fp8_unpacked
from kernels.fused_moe_align import moe_align_fused
from kernels.mxfp4_unpack import AHEAD_TILES, UnpackTiles, mxfp4_unpacked


def experts_unpacked(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, tiles: UnpackTiles | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored experts [E, N, K(/2)] -> [E, N, K] in `dtype` (bf16 for the grouped GEMM). tiles: the MXFP4 unpack's
    launch (None: its table's); out: the [E, N, K] tensor to write (MXFP4: bf16), for quantized experts."""
    if scale is None:
        return w if w.dtype == dtype else w.to(dtype)
    if w.dtype == torch.int8:
        return mxfp4_unpacked(w, scale, tiles, out).to(dtype)
    E, N, K = w.shape
    flat = None if out is None else out.view(E * N, K)
    return fp8_unpacked(w.reshape(E * N, K), scale.reshape(-1, scale.shape[-1]), dtype, flat).view(E, N, K)


def unpacked_shape(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, int, int]:
    """[E, N, K] of stored experts (MXFP4: two weights a byte)."""
    E, N, K = w.shape
    return (E, N, 2 * K) if scale is not None and w.dtype == torch.int8 else (E, N, K)


@dataclass(frozen=True)
class UnpackedExperts:
    """A layer's routed experts unpacked ahead of its MoE call (unpack_ahead): w1, w3, w2 [E, N, K] in the call's
    dtype, and the CUDA event they are complete at (None: already complete, as on the CPU)."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    ready: torch.cuda.Event | None


_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the unpack's stream, created on first use


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def unpack_ahead(w1, w3, w2, scales, dtype: torch.dtype) -> UnpackedExperts:
    """Start unpacking the stored experts (w1/w3 [E, I, D(/2)], w2 [E, D, I(/2)], `scales` as moe_experts') for a
    later moe_experts_grouped call in `dtype`: on CUDA on a side stream with the grid-limited unpack (AHEAD_TILES: a
    few SMs), so it runs beside the main stream's kernels until the call waits on the event; on the CPU now.

    Fork / join on streams: the side stream waits for the main stream's work so far, and the main stream waits on
    the recorded event before it reads; CUDA-graph capture records both edges, so a captured step keeps the
    overlap. The outputs are allocated on the main stream before the fork: the caching allocator ties their
    memory to the main stream, which frees them only after it has waited on the unpack."""
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    weights = ((w1, s1), (w3, s3), (w2, s2))
    if scales is not None and w1.dtype == torch.int8 and dtype != torch.bfloat16:
        raise ValueError(f"MXFP4 experts unpack to bf16 (the grouped GEMM's dtype), not {dtype}")
    if not w1.is_cuda:
        return UnpackedExperts(*(experts_unpacked(w, s, dtype, AHEAD_TILES) for w, s in weights), None)
    # dense experts: nothing to unpack (a cast, if any, stays on the main stream)
    outs = [experts_unpacked(w, s, dtype) if s is None else torch.empty(unpacked_shape(w, s), dtype=dtype,
                                                                         device=w.device) for w, s in weights]
    main, side = torch.cuda.current_stream(w1.device), _side_stream(w1.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for (w, s), out in zip(weights, outs):
            if s is not None:
                experts_unpacked(w, s, dtype, AHEAD_TILES, out)
        ready = torch.cuda.Event()
        ready.record(side)
    return UnpackedExperts(*outs, ready)


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


def moe_experts_grouped(x, w1, w3, w2, weights, indices, limit, scales=None, unpacked: UnpackedExperts | None = None):
    """kernels.reference.moe_experts' signature: x [T, D], w1/w3 [E, I, D(/2)], w2 [E, D, I(/2)] as stored,
    weights / indices [T, k]; `unpacked`: these experts from unpack_ahead, used instead of unpacking them here."""
    T, D = x.shape
    E = w1.shape[0]
    k = indices.shape[1]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    n_pairs = T * k
    if unpacked is not None and unpacked.ready is not None:
        torch.cuda.current_stream(x.device).wait_event(unpacked.ready)  # before any return: the outputs' memory
    if n_pairs == 0:
        return out
    idx = indices.reshape(-1).contiguous()
    sorted_ids, expert_end, _, _ = moe_align_fused(idx, E, 16)  # only the order and the ends are used
    rows = x.index_select(0, torch.div(sorted_ids, k, rounding_mode="floor"))
    # without `unpacked`, one weight unpacked at a time (the scratch quant_configs.MOE_GROUPED_MAX_BYTES bounds)
    gate = grouped_mm(rows, unpacked.w1 if unpacked else experts_unpacked(w1, s1, x.dtype), expert_end)
    up = grouped_mm(rows, unpacked.w3 if unpacked else experts_unpacked(w3, s3, x.dtype), expert_end)
    h = clamped_swiglu_fused(gate, up, limit, out_dtype=x.dtype)
    y = grouped_mm(h, unpacked.w2 if unpacked else experts_unpacked(w2, s2, x.dtype), expert_end)
    pos = torch.empty_like(sorted_ids)  # each pair's row in the sorted order
    pos.scatter_(0, sorted_ids.long(), torch.arange(n_pairs, dtype=pos.dtype, device=x.device))
    rw = weights.reshape(-1).contiguous()
    _weighted_sum_kernel[(T, triton.cdiv(D, 1024))](y, pos, idx, rw, out, T, D, TOPK=k, BLOCK=1024)
    return out
