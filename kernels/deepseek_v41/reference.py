"""Torch references for DeepSeek-V4.1's hot ops whose arithmetic differs from V4's: the spec the
V4.1 fused kernels must match (kernels/deepseek_v41/fused.py), bound by the dispatcher in kernels/__init__.py
as `v41_<name>`.

Each mirrors transformers' DeepseekV41 code step by step, including where it computes in float32
inside a float64 (or bf16) model (norm statistics, RoPE, mHC, the QAT fake-quantisers, the router, SwiGLU), so a
float64 run reproduces the float64 reference to ~1e-6.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.reference import local_experts

# --- norms, RoPE --------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in fp32, cast back, then the weight (the reference's order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair RoPE on the trailing 2 * cos.shape[-1] channels; x [T, D] or [T, H, D],
    cos/sin [T, r/2] in the model dtype. inverse: the conjugate rotation (attention output)."""
    if inverse:
        sin = -sin
    r = cos.shape[-1] * 2
    nope, rot = x[..., :-r], x[..., -r:]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = rot[..., 0::2].float(), rot[..., 1::2].float()
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


# --- QAT fake-quantisers (always on in the reference forward) -----------------------------------

_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale: 2^ceil(log2 t) for fp32 t > 0, from the IEEE bits as the reference kernel does."""
    bits = t.contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.to(torch.float32))


@functools.cache
def _e2m1_grid(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rounding thresholds, values) on `device`, made once: a tensor from host values inside a
    forward would be a host-to-device copy, which a CUDA graph capture refuses."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    ties_up = torch.tensor([False, True, False, True, False, True, False])
    thresholds = torch.where(ties_up, bounds, torch.nextafter(bounds, torch.full_like(bounds, float("inf"))))
    return thresholds.to(device), torch.tensor(_FP4_VALUES, dtype=torch.float32).to(device)


def _e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e2m1 grid (values, not codes)."""
    thresholds, values = _e2m1_grid(q.device)
    codes = (q.abs().unsqueeze(-1) >= thresholds).sum(-1) + 8 * torch.signbit(q).long()
    return values[codes]


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """FP4 e2m1 per `block` channels: ue8m0 scales (indexer keys and queries, block 32) or e4m3
    scales (compressed KV, block 16). Last dims that are not a block multiple pass unquantised."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().view(*x.shape[:-1], n // block, block)
    amax = b.abs().amax(-1)
    if e4m3_scales:
        scale = (amax.clamp_min(6.0 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
    else:
        scale = _pow2_ceil(amax.clamp_min(6.0 * 2.0**-126) * (1.0 / 6.0))
    q = _e2m1_round((b / scale.unsqueeze(-1)).clamp(-6.0, 6.0))
    return (q * scale.unsqueeze(-1)).view(x.shape).to(x.dtype)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with a ue8m0 scale per `block` channels (window KV, RoPE tail included)."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().view(*x.shape[:-1], n // block, block)
    scale = _pow2_ceil(b.abs().amax(-1).clamp_min(1e-4) * (1.0 / 448.0))
    q = (b / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale.unsqueeze(-1)).view(x.shape).to(x.dtype)


# --- single-pass mHC ----------------------------------------------------------------------------


def hc_site(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]), all fp32. `pre` is for the
    NEXT site's collapse (V4.1's single pass)."""
    hc = h.shape[1]
    flat = h.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * s[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * h.float()).sum(dim=1).to(h.dtype)


def hc_site_collapse(h: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor, hc_eps: float, norm_eps: float, sinkhorn_iters: int):
    """One mHC site of the single pass: this site's (pre, post, comb) from h, and h collapsed with
    the previous site's pre_in [T, hc] -> (pre, post, comb, collapsed [T, D])."""
    pre, post, comb = hc_site(h, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return pre, post, comb, hc_collapse(h, pre_in)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """stream k = post_k * out + sum_j comb[j, k] * residual_j, in fp32."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), residual.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(residual.dtype)


# --- MoE: router, SwiGLU --------------------------------------------------------------------------


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
           scoring_func: str, gate_temp: float, renorm: bool,
           expert_span: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc: fp32 scores; the bias steers selection only. -> (weights [T, k] fp32, indices; with expert_span
    (lo, hi) the indices as kernels.reference.local_experts gives them)."""
    logits = F.linear(x.float(), weight.float()) / gate_temp
    if scoring_func == "sqrtsoftplus":
        scores = torch.sqrt(F.softplus(logits))
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    indices = (scores + bias.float()).topk(top_k, dim=-1).indices
    w = scores.gather(1, indices)
    if renorm and top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, indices if expert_span is None else local_experts(indices, expert_span)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """In fp32; out_dtype: the result rounded to it once (the shared expert's w2 input), else fp32."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up, gate = up.clamp(min=-limit, max=limit), gate.clamp(max=limit)
    out = F.silu(gate) * up
    return out if out_dtype is None else out.to(out_dtype)


def moe_sum(routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MoE's output: routed + shared experts added in fp32, rounded once to `dtype`."""
    return (routed.float() + shared.float()).to(dtype)


# --- Engram ---------------------------------------------------------------------------------------


def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Engram's write into the hc streams: h [T, hc, D], kv [T, (hc + 1) * D] (the table rows through
    wkv: hc keys, then one value). Stream k gains sigmoid(signed sqrt(match)) * value, where match is
    the RMS-normalised h_k . (q_weight_k * k_weight_k * key_k) / sqrt(D); fp32, rounded once to h's dtype."""
    hc, D = h.shape[1], h.shape[2]
    key, value = kv.split([hc * D, D], dim=-1)
    key = key.float().unflatten(-1, (hc, D))
    w = q_weight.float() * k_weight.float()
    hf = h.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * w * key).sum(-1) * rstd * D**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)


def engram_gather(ids: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, lo: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Table rows [*ids.shape, D] in `dtype`: row ids - lo of `rows` [n, D] (the rows [lo, lo + n) of a table
    this rank holds; stored floats, or e4m3 with `scale` [n, D / c], one scale per c channels: ue8m0 bytes
    or floats, applied in float32); an id outside [lo, lo + n) (another rank's row) gives zeros. out: written
    and returned. The table may live in host memory mapped for the GPU (kernels/deepseek_v41/engram_gather.py)."""
    from kernels.formats import scale_to_float

    local = ids - lo
    mine = (local >= 0) & (local < rows.shape[0])
    idx = torch.where(mine, local, 0).reshape(-1)
    got = rows.index_select(0, idx)
    if scale is not None:
        s = scale_to_float(scale.index_select(0, idx))
        got = (got.float().unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
    got = torch.where(mine.reshape(-1, 1), got.to(dtype), torch.zeros((), dtype=dtype, device=got.device))
    got = got.view(*ids.shape, rows.shape[-1])
    return got if out is None else out.copy_(got)
