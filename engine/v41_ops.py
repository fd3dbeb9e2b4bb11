"""The DeepSeek-V4.1 ops whose arithmetic differs from V4's: torch, packed tokens [T, ...].

Each mirrors transformers' DeepseekV41 code step by step, including where it computes in float32
inside a float64 (or bf16) model (router, SwiGLU, the two-level top-k), so a float64 run
reproduces the float64 reference to ~1e-6. Norms, RoPE, the fake-quantisers and mHC live in
kernels/reference_v41.py, the spec of their fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# norms, RoPE, the fake-quantisers and mHC: kernels/reference_v41.py (the fused kernels' spec)
from kernels.reference_v41 import (  # noqa: F401
    fake_quant_fp4,
    fake_quant_fp8,
    hc_collapse,
    hc_expand,
    hc_site,
    rms_norm,
    rope,
)

# --- MoE ----------------------------------------------------------------------------------------


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
           scoring_func: str, gate_temp: float, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc: fp32 scores; the bias steers selection only. -> (weights [T, k] fp32, indices)."""
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
    return w * scaling, indices


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate.float(), up.float()
    if limit > 0:
        up, gate = up.clamp(min=-limit, max=limit), gate.clamp(max=limit)
    return F.silu(gate) * up


def routed_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   indices: torch.Tensor, limit: float) -> torch.Tensor:
    """fp32 sum over each token's experts of w2(weight * swiglu(w1 x, w3 x)): the routing weight
    multiplies the activation before the down projection (the reference's order)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    hit = torch.unique(indices).tolist()
    for e in hit:
        tok, k = torch.where(indices == e)
        xe = x[tok]
        act = clamped_swiglu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), limit) * weights[tok, k, None]
        out.index_add_(0, tok, F.linear(act.to(x.dtype), w2[e]).float())
    return out


# --- two-level top-k ----------------------------------------------------------------------------


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one: per query, the `topk_blocks` best blocks of `block` entries (block score = max;
    the block of the newest visible entry pinned in). scores [n, E] with invisible at -inf,
    visible [n] counts -> bool mask [n, E]."""
    width = scores.shape[-1]
    s = F.pad(scores, (0, -width % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    nb = s.shape[-1]
    last = torch.div(visible - 1, block, rounding_mode="floor").unsqueeze(-1)
    s = s.masked_fill(torch.arange(nb, device=s.device) == last, float("inf"))
    top = s.topk(min(topk_blocks, nb), dim=-1)
    keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.unsqueeze(-1).expand(*keep.shape, block).flatten(-2)[..., :width]  # no host sizing (graphs)
