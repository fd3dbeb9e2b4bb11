"""An FP8 block-scaled weight unpacked to a dense tensor: e4m3 [N, K] times its float32 B x B block
scales (kernels.formats.fp8_block_of), rounded once to the output dtype. One pass: each e4m3 byte read
once, each output element written once. The float32 product is the one kernels.formats.
dequantize_fp8_block computes, so the result equals `dequantize_fp8_block(w, s).to(dtype)` exactly.
Used by kernels/fused_fp8_linear.py's "unpacked" variant (the weight unpacked per call, then torch's
GEMM) where its own FP8 kernels lose to that."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import fp8_block_of


@triton.jit
def _unpack_kernel(w_ptr, s_ptr, out_ptr, N, K, B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (n // B)[:, None] * tl.cdiv(K, B) + (k // B)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + n[:, None] * K + k[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_unpacked(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight e4m3 [N, K], scale float32 [cdiv(N, B), cdiv(K, B)] -> [N, K] in `dtype`."""
    block = fp8_block_of(weight.shape, scale.shape)
    weight, scale = weight.contiguous(), scale.float().contiguous()
    N, K = weight.shape
    out = torch.empty(N, K, dtype=dtype, device=weight.device)
    if N and K:
        grid = (triton.cdiv(N, 32), triton.cdiv(K, 128))
        _unpack_kernel[grid](weight, scale, out, N, K, B=block, BLOCK_N=32, BLOCK_K=128)
    return out
