"""DeepSeek-V4.1's fused ops (the kernels API's `v41_*`), each with the signature of its torch reference in
kernels/reference_v41.py. Where V4.1's arithmetic is V4's up to an order of rounding, they launch V4's
kernels (kernels/fused_norm_mhc.py, kernels/fused_rope.py) with a flag, not new ones."""

from __future__ import annotations

import torch
import triton

from kernels.fused_fake_quant import fake_quant_fp4_fused, fake_quant_fp8_fused
from kernels.fused_norm_mhc import _rms_norm_kernel, _rows, hc_post_fused, hc_site_collapse_fused
from kernels.fused_rope import _launch as _rope_launch

__all__ = ["hc_site_collapse_fused", "hc_expand_fused", "rms_norm_fused", "rope_fused", "fake_quant_fp4_fused",
           "fake_quant_fp8_fused"]


def hc_expand_fused(out, residual, post, comb):
    """V4.1's expand is V4's hc_post in fp32 (the kernel's arithmetic), its arguments in another order."""
    return hc_post_fused(residual, out, post, comb)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4.1's RMSNorm: statistics in fp32, the row cast back to x's dtype, then the weight."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps, HAS_W=True,
                                     BLOCK=triton.next_power_of_2(x2.shape[1]), CAST_FIRST=True)
    return out.view(x.shape)


def rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE on the trailing 2 * cos.shape[-1] channels (inverse: the conjugate)."""
    x = x.contiguous()
    return _rope_launch(x, None, cos, sin, 0.0, False, torch.empty_like(x), sin_sign=-1.0 if inverse else 1.0)
