"""The DeepSeek-V4.1 ops whose arithmetic differs from V4's: torch, packed tokens [T, ...].

Each mirrors transformers' DeepseekV41 code step by step, including where it computes in float32
inside a float64 (or bf16) model (the routed experts, the two-level top-k), so a float64 run
reproduces the float64 reference to ~1e-6. Norms, RoPE, the fake-quantisers, mHC, the router and SwiGLU live in
kernels/deepseek_v41/reference.py, the spec of their fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# norms, RoPE, the fake-quantisers, mHC, the router and SwiGLU: kernels/deepseek_v41/reference.py (the kernels' spec)
from kernels.deepseek_v41.reference import (  # noqa: F401
    clamped_swiglu,
    fake_quant_fp4,
    fake_quant_fp8,
    hc_collapse,
    hc_expand,
    hc_site,
    rms_norm,
    rope,
    router,
)
from kernels.reference import topk_by_score_then_index

# --- MoE ----------------------------------------------------------------------------------------


def routed_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   indices: torch.Tensor, limit: float) -> torch.Tensor:
    """fp32 sum over each token's experts of w2(weight * swiglu(w1 x, w3 x)): the routing weight
    multiplies the activation before the down projection (the reference's order). An index of -1 is
    a pair another rank computes (expert parallel): it adds nothing here."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    hit = [e for e in torch.unique(indices).tolist() if e >= 0]
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
    values, indices = topk_first(s, min(topk_blocks, nb))
    keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
    return keep.unsqueeze(-1).expand(*keep.shape, block).flatten(-2)[..., :width]  # no host sizing (graphs)


def topk_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores.topk(k) over the last dim (fp32), ties going to the lower index: torch's own choice
    among equal scores (relu'd index scores tie at 0) depends on the row's length, and a padded
    step's rows are longer than the eager step's (kernels.reference.topk_by_score_then_index, V4's
    indexer rule). -> (values, indices), best first."""
    indices = topk_by_score_then_index(scores, k)
    return scores.gather(-1, indices), indices
