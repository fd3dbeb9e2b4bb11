"""DeepSeek-V4.1's fused ops (the kernels API's `v41_*`), each with the signature of its torch reference in
kernels/deepseek_v41/reference.py. Where V4.1's arithmetic is V4's up to an order of rounding, they launch V4's
kernels (kernels/fused_norm_mhc.py, kernels/fused_rope.py) with a flag, not new ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.activations import clamped_swiglu
from kernels.deepseek_v41 import reference
from kernels.fused_fake_quant import fake_quant_fp4_fused, fake_quant_fp8_fused
from kernels.fused_gate import _SCORING, _router_kernel, span_args
from kernels.fused_norm_mhc import _rms_norm_kernel, _rows, hc_post_fused, hc_site_collapse_fused
from kernels.fused_rope import _launch as _rope_launch
from kernels.pdl import wait_and_release

__all__ = ["hc_site_collapse_fused", "hc_expand_fused", "rms_norm_fused", "rope_fused", "fake_quant_fp4_fused",
           "fake_quant_fp8_fused", "router_fused", "clamped_swiglu_fused", "moe_sum_fused", "engram_gate_fused"]


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


def router_fused(x, weight, bias, top_k, scaling, scoring_func, gate_temp, renorm, expert_span=None):
    """V4.1's noaux router: the fp32 gate GEMM (cuBLAS), then V4's one program per token for scores,
    bias, top-k, renormalisation and scale (and expert_span's local ids: kernels.reference.router_topk's). Without
    renormalisation (V4's kernel always renormalises): the reference."""
    if not (renorm and top_k > 1) or bias is None or x.shape[0] == 0:
        return reference.router(x, weight, bias, top_k, scaling, scoring_func, gate_temp, renorm, expert_span)
    logits = F.linear(x.float(), weight.float())
    if gate_temp != 1.0:
        logits = logits / gate_temp
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    _router_kernel[(T,)](logits, bias.float().contiguous(), w, idx, E, scaling, K=top_k,
                         KP=triton.next_power_of_2(top_k), SCORING=_SCORING[scoring_func],
                         BLOCK_E=triton.next_power_of_2(E), **span_args(expert_span))
    return w, idx


@triton.jit(do_not_specialize=["N"])  # N follows the step's token count (kernels/fused.py says why)
def _pair_kernel(a_ptr, b_ptr, out_ptr, N, limit, OP: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Elementwise over two inputs in fp32, one rounding to out's dtype. OP 0: the clamped SwiGLU of
    (gate a, up b); 1: a + b."""
    wait_and_release(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    a = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
    if OP == 0:
        y = clamped_swiglu(a, b, limit, CLAMP)
    else:
        y = a + b
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)


def _pair(a, b, dtype, op, limit=0.0):
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=dtype, device=a.device)
    n, block = a.numel(), 1024
    if n:
        _pair_kernel[(triton.cdiv(n, block),)](a, b, out, n, float(limit), OP=op, CLAMP=limit > 0, BLOCK=block,
                                               **pdl.options(a))
    return out


def clamped_swiglu_fused(gate: torch.Tensor, up: torch.Tensor, limit: float,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate clamped above) * up clamped both ways, in fp32, one launch."""
    return _pair(gate, up, out_dtype or torch.float32, 0, limit)


def moe_sum_fused(routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _pair(routed, shared, dtype, 1)


@triton.jit
def _engram_gate_kernel(h_ptr, kv_ptr, qw_ptr, kw_ptr, out_ptr, D, eps, scale, HC: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program per (token, stream): the three row sums over D, then the gated write."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    h_row = h_ptr + (t * HC + k) * D
    key_row = kv_ptr + t * (HC + 1) * D + k * D
    hh = tl.zeros((BLOCK,), tl.float32)
    kk = tl.zeros((BLOCK,), tl.float32)
    hk = tl.zeros((BLOCK,), tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        m = d < D
        h = tl.load(h_row + d, mask=m, other=0.0).to(tl.float32)
        key = tl.load(key_row + d, mask=m, other=0.0).to(tl.float32)
        w = tl.load(qw_ptr + k * D + d, mask=m, other=0.0).to(tl.float32) * tl.load(kw_ptr + k * D + d, mask=m,
                                                                                    other=0.0).to(tl.float32)
        hh += h * h
        kk += key * key
        hk += h * w * key
    rstd = tl.rsqrt(tl.sum(hh, axis=0) / D + eps) * tl.rsqrt(tl.sum(kk, axis=0) / D + eps)
    dot = tl.sum(hk, axis=0) * rstd * scale
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = tl.sigmoid(tl.where(dot < 0, -root, root))
    val_row = kv_ptr + t * (HC + 1) * D + HC * D
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        m = d < D
        h = tl.load(h_row + d, mask=m, other=0.0).to(tl.float32)
        v = tl.load(val_row + d, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + (t * HC + k) * D + d, (h + gate * v).to(out_ptr.dtype.element_ty), mask=m)


def engram_gate_fused(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
    T, hc, D = h.shape
    h, kv = h.contiguous(), kv.contiguous()
    out = torch.empty_like(h)
    if T:
        _engram_gate_kernel[(T, hc)](h, kv, q_weight.contiguous(), k_weight.contiguous(), out, D, eps, D**-0.5,
                                     HC=hc, BLOCK=min(1024, triton.next_power_of_2(D)))
    return out
