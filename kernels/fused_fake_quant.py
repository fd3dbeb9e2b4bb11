"""DeepSeek-V4.1's QAT fake-quantisers in one launch each (kernels.deepseek_v41.reference.fake_quant_fp4 / _fp8):
per `block` channels of a row, the block's absmax picks a scale, the values round onto the FP8 e4m3
or FP4 e2m1 grid and come back multiplied by it. One program per row, the row as [blocks, block].

The torch references take ~20 tiny ops per call (amax, the ue8m0 scale from the float's bits, the
e2m1 thresholds as a gather); a decode step calls them three or four times per layer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_fp8_linear import _round_e4m3

# the interpreter's float32 -> e4m3 cast is wrong above 64 (kernels/fused_fp8_linear.py): exact arithmetic there
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _e4m3(v, ARITH: tl.constexpr):
    if ARITH:
        return _round_e4m3(v)
    return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _pow2_ceil(t):
    """ue8m0: 2^ceil(log2 t) for normal fp32 t > 0, from the bits (exact, as the reference)."""
    bits = t.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (k << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(q):
    """Round to nearest, ties to even, onto 0, 0.5, 1, 1.5, 2, 3, 4, 6 (sign kept); |q| <= 6."""
    a = tl.abs(q)
    v = tl.where(a > 0.25, 0.5, 0.0)
    v = tl.where(a >= 0.75, 1.0, v)
    v = tl.where(a > 1.25, 1.5, v)
    v = tl.where(a >= 1.75, 2.0, v)
    v = tl.where(a > 2.5, 3.0, v)
    v = tl.where(a >= 3.5, 4.0, v)
    v = tl.where(a > 5.0, 6.0, v)
    return tl.where(q < 0, -v, v)


@triton.jit
def _fake_quant_kernel(x_ptr, out_ptr, N, MODE: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                       ARITH: tl.constexpr):
    """MODE 0: FP8 e4m3, ue8m0 scale; 1: FP4 e2m1, ue8m0 scale; 2: FP4 e2m1, e4m3 scale."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    m = b * BLOCK + c < N
    offs = row * N + b * BLOCK + c
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)[:, None]
    if MODE == 0:
        scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        q = _e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0), ARITH)
    elif MODE == 1:
        scale = _pow2_ceil(tl.maximum(amax, 7.052966104933725e-38) * (1.0 / 6.0))  # 6 * 2^-126
        q = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -6.0), 6.0))
    else:
        scale = _e4m3(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), ARITH)  # 6 * 2^-9
        q = _e2m1(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -6.0), 6.0))
    tl.store(out_ptr + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=m)


def _launch(x: torch.Tensor, block: int, mode: int) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        return x
    assert block & (block - 1) == 0, f"the fused fake-quantiser needs a power-of-two block, got {block}"
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        _fake_quant_kernel[(rows,)](x, out, n, MODE=mode, NB=triton.next_power_of_2(n // block), BLOCK=block,
                                    ARITH=_INTERPRET)
    return out


def fake_quant_fp4_fused(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    return _launch(x, block, 2 if e4m3_scales else 1)


def fake_quant_fp8_fused(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _launch(x, block, 0)
