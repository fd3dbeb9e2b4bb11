"""Torch references for every hot op of DeepSeek-V4: the spec the fused kernels must match.

Plain code, one function per equation block, dtype policy mirroring transformers'
DeepseekV4 (norms, mHC, Sinkhorn, router scores and softmaxes in fp32; the rest in the
model dtype), so the engine's logits match the reference model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F

from kernels.formats import dequantize_fp8_block, dequantize_mxfp4, fp8_block_of, quantize_act_1x128

# --- rounding where the served kernels round (kernels.set_backend("rounded")) ------------------
# None: the references round only to the dtype they run in (CPU serving in bf16, the float32
# reference). A dtype: they run in float32 and round to it where the fused kernels store an
# activation (each launch's output; see `stored`'s call sites) and quantize activations to e4m3
# where the served FP8 GEMM does, so that a comparison with the engine sees its kernels' error, not
# its storage's (tools/check_teacher_forced.py --reference rounded).
_store_dtype: torch.dtype | None = None


def set_rounding(dtype: torch.dtype | None) -> None:
    global _store_dtype
    _store_dtype = dtype


def rounding() -> torch.dtype | None:
    return _store_dtype


# --- accumulation order (kernels.set_backend("reordered"): the teacher-forced check's noise floor) ------------
# Off: every contraction sums over K as torch does. On: over each half of K apart, the two partials added in float32,
# and a token's routed expert rows added in the reverse expert order. Both are freedoms the served kernels really
# have (the FP8 linear's split-K float32 partials, a GEMM's K tiles, flash-decoding's key splits, the MoE's row
# sums in any order) and neither order is more correct: the rounded references run once each way, and how far they
# part is what summation order alone moves (tools/teacher_forced_floor.py).
_reordered = False


def set_reordered(on: bool) -> None:
    global _reordered
    _reordered = on


def over_k(product: Callable, a: torch.Tensor, b: torch.Tensor, dim_a: int, dim_b: int) -> torch.Tensor:
    """product(a, b), a contraction of a's dim_a with b's dim_b: whole, or reordered, its two halves of K apart,
    then added (V4's K are multiples of 256: the halves fall on the FP8 128-blocks)."""
    k = a.shape[dim_a]
    if not _reordered or k < 2:
        return product(a, b)
    h = k // 2
    return product(a.narrow(dim_a, 0, h), b.narrow(dim_b, 0, h)) + product(a.narrow(dim_a, h, k - h),
                                                                           b.narrow(dim_b, h, k - h))


def stored(t: torch.Tensor) -> torch.Tensor:
    """t as the served kernels leave it in memory: rounded to the storage dtype (same dtype kept)."""
    if _store_dtype is None or not t.is_floating_point() or t.dtype == _store_dtype:
        return t
    return t.to(_store_dtype).to(t.dtype)


def _act_quant_as_served(x2: torch.Tensor, m: int, n: int, block: int) -> bool:
    """Whether the fused FP8 linear of m rows quantizes x2's activations (its "mma" / "cublas" variants; the GEMVs
    multiply them as stored): only with rounding on. The CPU serves these references, so the rounded reference
    mirrors the kernels as served on CUDA (or forced under the interpreter), not the CPU path."""
    if _store_dtype is None:
        return False
    from kernels.fused_fp8_linear import tiles  # needs triton, as the kernels it mirrors

    return tiles(m, n, x2.shape[-1], block=block)[0] in ("mma", "cublas")


def _as_served_input(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, n: int,
                     groups: int = 1) -> torch.Tensor:
    """x as the served FP8 linear (n rows of output per group) multiplies it: e4m3 per 1x128 block of each
    row (of each group's slice) where it quantizes, else as is."""
    if scale is None or weight.dtype != torch.float8_e4m3fn:
        return x
    x2 = x.reshape(-1, x.shape[-1])
    if not _act_quant_as_served(x2, x2.shape[0] // groups, n, fp8_block_of(weight.shape, scale.shape)):
        return x
    return act_quant_1x128(x2).to(x.dtype).view(x.shape)


def act_quant_1x128(x2: torch.Tensor) -> torch.Tensor:
    """Activations [M, K] as the FP8 tensor-core GEMM multiplies them: e4m3 per 1x128 block, float32."""
    xq, xs = quantize_act_1x128(x2)
    return xq.float() * xs.repeat_interleave(128, -1)[:, : x2.shape[-1]]


# --- norms ------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm; weights are fp32, multiply in fp32, cast once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return stored((weight * h).to(x.dtype))


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# --- RoPE (interleaved pairs, on the trailing rope_dim slice of each head) ---------------------

def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin [T, rope_dim/2], angles in fp32 as the reference computes them."""
    freqs = positions[:, None].float() * inv_freq.float()
    return stored(freqs.cos().to(dtype)), stored(freqs.sin().to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d]; cos/sin [T, r/2] broadcast over the middle dims; rotates x[..., -r:]."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = stored((rope.float() * cos + rotated_half.float() * sin).to(x.dtype))
    return torch.cat([nope, rotated], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              eps: float) -> torch.Tensor:
    """RMSNorm (weighted, or per-head unweighted for q) then RoPE."""
    y = rms_norm(x, weight, eps) if weight is not None else stored(rms_norm_unweighted(x, eps))
    return apply_rope(y, cos, sin)


def kv_norm_rope_insert(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                        pool: torch.Tensor, slots: torch.Tensor) -> None:
    """The shared K=V latent: norm, RoPE, straight into the window cache at `slots`."""
    y = apply_rope(rms_norm(kv, weight, eps), cos, sin)
    pool.view(-1, pool.shape[-1]).index_copy_(0, slots, y.to(pool.dtype))


def q_kv_norm_rope(q: torch.Tensor, kv: torch.Tensor, kv_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Attention's query heads (norm_rope, unweighted) and its K=V latent (kv_norm_rope_insert) -> the query."""
    out = norm_rope(q, None, cos, sin, eps)
    kv_norm_rope_insert(kv, kv_weight, cos, sin, eps, pool, slots)
    return out


# --- mHC (manifold-constrained hyper-connections, paper section 2.2) ---------------------------

def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           hc_eps: float, norm_eps: float, sinkhorn_iters: int):
    """x [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
    T, hc, _ = x.shape
    flat = rms_norm_unweighted(x.reshape(T, -1).float(), norm_eps)
    mixes = over_k(F.linear, flat, fn.float(), -1, -1)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    # Sinkhorn-Knopp onto doubly-stochastic matrices (20 iterations in V4)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = stored((pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype))
    return post, comb, collapsed


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new streams = post * block output + comb^T @ old streams."""
    dtype = x.dtype
    return stored(post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x))


def hc_post_pre_norm(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                     base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor, hc_eps: float, norm_eps: float,
                     out_eps: float, sinkhorn_iters: int):
    """Mega-mHC: one sublayer's hc_post, the next sublayer's hc_pre and its RMSNorm.
    -> (new streams [T, hc, D], post, comb, the next sublayer's normed input [T, D])."""
    new = hc_post(h, out, post, comb)
    post2, comb2, x = hc_pre(new, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return new, post2, comb2, rms_norm(x, norm_w, out_eps)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    flat = rms_norm_unweighted(x.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(over_k(F.linear, flat, fn.float(), -1, -1) * scale.float() + base.float()) + hc_eps
    return stored((pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype))


# --- MoE --------------------------------------------------------------------------------------

def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def local_experts(indices: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Global routed expert ids -> those of the experts in [span[0], span[1]) counted from span[0] (one rank's under
    expert parallelism); -1 for the others (another rank's: the MoE skips them)."""
    lo, hi = span
    return torch.where((indices >= lo) & (indices < hi), indices - lo, -1)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                routed_scaling: float, scoring_func: str, hash_ids: torch.Tensor | None = None,
                expert_span: tuple[int, int] | None = None):
    """Router gate: scores, selection (bias only for choosing, or a hash table), renormalise, scale.
    Returns (weights [T, k], indices [T, k]); expert_span (lo, hi): the indices as local_experts gives them
    (selection and weights over every expert, as before)."""
    scores = _scores(stored(over_k(F.linear, x, weight, -1, -1)), scoring_func)  # the served GEMM's logits: stored
    if hash_ids is not None:
        indices = hash_ids.long()
    else:
        indices = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, indices)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return stored(w * routed_scaling), indices if expert_span is None else local_experts(indices, expert_span)


def moe_align(indices: torch.Tensor, num_experts: int, block_m: int):
    """The fused MoE's row layout: (token, expert) pair ids grouped by expert, cut into tiles of
    block_m rows that never straddle two experts. Returns sorted_ids int32 [n_pairs] (pair ids,
    expert-major; within an expert in pair order here, any order in the kernel; pairs of index -1,
    another rank's experts, last and in no tile), expert_end int32 [E] (the end of each expert's
    run in sorted_ids), block_expert int32 [max_blocks] (-1: unused) and block_start int32
    [max_blocks] (the tile's first index into sorted_ids). max_blocks = cdiv(n_pairs, block_m) +
    min(E, n_pairs) bounds the tiles without a host sync."""
    flat = indices.reshape(-1)
    flat = torch.where(flat < 0, num_experts, flat)  # skipped pairs: one slot past the experts
    n_pairs, dev = flat.numel(), flat.device
    max_blocks = -(-n_pairs // block_m) + min(num_experts, n_pairs)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    end = torch.cumsum(counts, 0)[:num_experts]
    counts = counts[:num_experts]
    n_blk = (counts + block_m - 1) // block_m
    blk_end = torch.cumsum(n_blk, 0)
    b = torch.arange(max_blocks, device=dev)
    expert = torch.searchsorted(blk_end, b, right=True)
    used = b < blk_end[-1]
    expert = torch.where(used, expert, 0)
    start = end[expert] - counts[expert] + (b - (blk_end[expert] - n_blk[expert])) * block_m
    return (torch.argsort(flat, stable=True).int(), end.int(), torch.where(used, expert, -1).int(),
            torch.where(used, start, 0).int())


# --- quantized weights (kernels/formats.py): dequantize, then the plain op ---------------------

def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A stored weight in `dtype`: as is (scale None), FP8 block (e4m3) or MXFP4 (packed int8)."""
    if scale is None:
        return weight.to(dtype)
    if weight.dtype == torch.int8:
        return dequantize_mxfp4(weight, scale).to(dtype)
    return dequantize_fp8_block(weight, scale).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A dense linear; with `scale`, weight is FP8 e4m3 with 128x128 block scales."""
    x = _as_served_input(x, weight, scale, weight.shape[0])
    return stored(over_k(F.linear, x, dequantize(weight, scale, x.dtype), -1, -1))


def linear_split(x: torch.Tensor, weight: torch.Tensor, split_n: int,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two linears of one input stacked along N (wq_a over wkv): (x @ W[:split_n]^T, x @ W[split_n:]^T)."""
    y = linear(x, weight, scale)
    return y[..., :split_n].contiguous(), y[..., split_n:].contiguous()


def linear_act_quant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 tensor-core GEMM's arithmetic: activations rounded to e4m3 per 1x128 block first."""
    xd = act_quant_1x128(x.reshape(-1, x.shape[-1]))
    return F.linear(xd, dequantize_fp8_block(weight, scale)).to(x.dtype).view(*x.shape[:-1], -1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return stored(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit))


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert's down projection of its SwiGLU: linear(swiglu(gate, up), weight, scale)."""
    return linear(swiglu(gate, up, limit), weight, scale)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """The q LoRA's up projection of its RMSNorm: linear(rms_norm(x, norm_weight, eps), weight, scale)."""
    return linear(rms_norm(x, norm_weight, eps), weight, scale)


def router_moe(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None, top_k: int,
               routed_scaling: float, scoring_func: str, hash_ids: torch.Tensor | None, w1: torch.Tensor,
               w3: torch.Tensor, w2: torch.Tensor, limit: float, scales=None,
               shared: torch.Tensor | None = None) -> torch.Tensor:
    """The router, then the routed experts on its pairs (every gate row an expert held here: no other rank's)."""
    weights, indices = router_topk(x, gate_weight, gate_bias, top_k, routed_scaling, scoring_func, hash_ids)
    return moe_experts(x, w1, w3, w2, weights, indices, limit, scales, shared)


def mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = over_k(F.linear, x, w1, -1, -1), over_k(F.linear, x, w3, -1, -1)
    return over_k(F.linear, swiglu(gate, up, limit), w2, -1, -1)


def moe_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                weights: torch.Tensor, indices: torch.Tensor, limit: float, scales=None,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: w1/w3 [E, I, D], w2 [E, D, I]; tokens grouped per expert. `scales`
    (w1, w3, w2 scales): the weights are stored FP8 block ([E, I, D] e4m3) or MXFP4 ([E, I, D/2]
    int8), each expert dequantized to x's dtype when it has tokens. An index of -1 is a pair
    another rank computes (expert parallel): it adds nothing here. `shared` [T, D] (the shared
    expert's output) is added to the routed sum, rounded to x's dtype first."""
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    out = torch.zeros_like(x)
    flat_idx = indices.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # the skipped pairs (-1) sort first
    counts = torch.bincount(flat_idx + 1, minlength=w1.shape[0] + 1).tolist()
    token_of = order // indices.shape[1]
    w_sorted = weights.reshape(-1)[order]
    starts = list(accumulate(counts))  # expert e's pairs from starts[e] (the skipped pairs before expert 0's)
    experts = range(w1.shape[0])
    for e in reversed(experts) if _reordered else experts:  # each token's rows added in this order
        n, start = counts[e + 1], starts[e]
        if n == 0:
            continue
        tok = token_of[start:start + n]
        we = [dequantize(w[e], None if sc is None else sc[e], x.dtype) for w, sc in ((w1, s1), (w3, s3), (w2, s2))]
        h = mlp(x[tok], *we, limit) * w_sorted[start:start + n, None]
        out.index_add_(0, tok, h.to(out.dtype))
    out = stored(out)  # the kernels' sum of a token's rows, rounded once, then the shared expert added
    return out if shared is None else stored(out + shared)


# --- attention --------------------------------------------------------------------------------

def sink_attention(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-KV MQA with per-head sinks. q [..., n, H, d], kv [..., K, d] (key = value),
    allowed [..., n, K] bool -> [..., n, H, d]; leading dims: independent batches (DSpark's blocks)."""
    logits = over_k(partial(torch.einsum, "...nhd,...kd->...nhk"), q, kv, -1, -1) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(-2), float("-inf"))
    sink = sinks.view(-1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink.to(torch.promote_types(logits.dtype, sinks.dtype))], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return stored(over_k(partial(torch.einsum, "...nhk,...kd->...nhd"), probs.to(kv.dtype), kv, -1, -2))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped low-rank output projection wo_a: x [T, G, in/G], weight [G*r, in/G] -> [T, G*r]
    (FP8 block-scaled with `scale`)."""
    T = x.shape[0]
    x = _as_served_input(x, weight, scale, weight.shape[0] // groups, groups)
    weight = dequantize(weight, scale, x.dtype)
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [G, in/G, r]
    return stored(over_k(torch.bmm, x.transpose(0, 1), w, -1, 1).transpose(0, 1).reshape(T, -1))


# --- compressor + lightning indexer (paper sections 2.3.1-2.3.2) ------------------------------

def pool_blocks(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
                     prev_gate: torch.Tensor | None, has_prev: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Pool complete blocks into compressed entries (before norm and RoPE).

    kv/gate [B, ratio, c * head_dim] (gate already has the position bias added). Without overlap
    (HCA) an entry is the softmax(gate)-weighted sum of its block. With overlap (CSA) it pools the
    block's Cb slice with the previous block's Ca slice prev_* [B, ratio, head_dim], where has_prev
    [B] (the first block of a sequence has none). -> [B, head_dim]"""
    if prev_kv is None:
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    have = has_prev[:, None, None]
    new_kv = torch.cat([torch.where(have, prev_kv.to(kv.dtype), 0), kv[..., head_dim:]], dim=1)
    new_gate = torch.cat([torch.where(have, prev_gate.to(gate.dtype), float("-inf")), gate[..., head_dim:]], dim=1)
    return (new_kv * new_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def compress_decode(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    pend_kv: torch.Tensor, pend_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                    prev_gate: torch.Tensor | None, has_prev: torch.Tensor | None, bnd_kv: torch.Tensor | None,
                    bnd_gate: torch.Tensor | None, norm_w: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                    pool: torch.Tensor, full_tables: torch.Tensor, block_size: int, ratio: int, head_dim: int,
                    ape: torch.Tensor | None = None) -> None:
    """The compressor's decode step for one new token per sequence (row i of the batch, state slot
    slots[i]): its gate plus the position bias ape[pos % ratio] when given (fp32, as the multi-row
    path adds it); add it to the sequence's open block; where it closes the block, pool, norm, RoPE at
    the block's first position and write the entry into `pool`; CSA (prev_* given) keeps the
    block's Ca slice for the next, and at a full-block end also in bnd_* (prefix caching).
    All sequences at once, no host sync (CUDA-graph safe)."""
    m, hd, pos = ratio, head_dim, positions
    if ape is not None:
        gate = gate + ape[pos % m]
    rows = torch.arange(pos.shape[0], device=pos.device)
    pend_kv[slots, pos % m] = kv.to(pend_kv.dtype)
    pend_gate[slots, pos % m] = gate.to(pend_gate.dtype)
    closing = pos % m == m - 1
    pk, pg = pend_kv[slots], pend_gate[slots]
    prev = (prev_kv[slots], prev_gate[slots], has_prev[slots]) if prev_kv is not None else (None,) * 3
    entries = rms_norm(pool_blocks(pk, pg, *prev, hd), norm_w, eps)
    cos, sin = rope_cos_sin((pos // m) * m, inv_freq, entries.dtype)
    entries = apply_rope(entries, cos, sin)
    per_block, e = pool.shape[1], pos // m
    flat = pool.view(-1, pool.shape[-1])
    idx = full_tables[rows, e // per_block] * per_block + e % per_block  # its own, allocated block
    flat[idx] = torch.where(closing[:, None], entries.to(pool.dtype), flat[idx])
    if prev_kv is not None:
        c = closing[:, None, None]
        if bnd_kv is not None:
            at_end = c & ((pos + 1) % block_size == 0)[:, None, None]
            blk = full_tables[rows, pos // block_size]
            bnd_kv[blk] = torch.where(at_end, pk[..., :hd], bnd_kv[blk])
            bnd_gate[blk] = torch.where(at_end, pg[..., :hd], bnd_gate[blk])
        prev_kv[slots] = torch.where(c, pk[..., :hd], prev_kv[slots])
        prev_gate[slots] = torch.where(c, pg[..., :hd], prev_gate[slots])
        has_prev[slots] = has_prev[slots] | closing


def compress_blocks(kv: torch.Tensor, gate: torch.Tensor, plan, state, norm_w: torch.Tensor, eps: float,
                    inv_freq: torch.Tensor, pool: torch.Tensor, full_tables: torch.Tensor, head_dim: int,
                    keep_closed: bool = False, positions: torch.Tensor | None = None, ape: torch.Tensor | None = None):
    """The compressor's multi-row step (prefill chunks, mixed steps, speculative verify): this step's
    rows kv/gate [T, c * head_dim] (gate with the position bias) against the open blocks in `state`
    (engine.cache.CompressorState), as `plan` (engine.compress_plan.CompressPlan) says. Every closed
    block is gathered from this step's rows or the open block (plan.src), pooled (CSA: with the
    previous block's Ca slice, from the state or this step), RMSNorm'd, RoPE'd at its first position
    and written at its paged entry in `pool`; CSA keeps each sequence's last Ca slice (and at full-block
    ends, prefix caching, in bnd_*); the rows left open go to pend_*. No host sync. ape given: gate is
    before its position bias, ape[positions % ratio] (fp32), added here.
    -> the closed blocks' rows (kv, gate) [blocks, ratio, c * head_dim] when keep_closed, else None."""
    m, hd, st = plan.ratio, head_dim, state
    if ape is not None:
        gate = gate + ape[positions % m]  # promotes to >= fp32, as the reference model
    C = kv.shape[-1]
    closed = None
    if plan.num_blocks:
        # every closed block of every sequence: rows from this step or from the open block
        kvb = torch.cat([kv, st.pend_kv.view(-1, C)])[plan.src].view(-1, m, C)
        gb = torch.cat([gate.to(st.pend_gate.dtype), st.pend_gate.view(-1, C)])[plan.src].view(-1, m, C)
        closed = (kvb, gb) if keep_closed else None
        prev = (None, None, None)
        if st.prev_kv is not None:  # block b pools with block b-1's Ca slice: this step's, or the state's
            prev = (torch.cat([st.prev_kv, kvb[..., :hd]])[plan.prev],
                    torch.cat([st.prev_gate, gb[..., :hd]])[plan.prev],
                    torch.cat([st.has_prev, st.has_prev.new_ones(plan.num_blocks)])[plan.prev])
        entries = rms_norm(pool_blocks(kvb, gb, *prev, hd), norm_w, eps)
        cos, sin = rope_cos_sin(plan.blk_entry * m, inv_freq, entries.dtype)
        entries = apply_rope(entries, cos, sin)
        per_block = pool.shape[1]
        dst = full_tables[plan.blk_seq, plan.blk_entry // per_block] * per_block + plan.blk_entry % per_block
        pool.view(-1, pool.shape[-1]).index_copy_(0, dst, entries.to(pool.dtype))
        if st.prev_kv is not None:
            if st.bnd_kv is not None and plan.bnd_blk.numel():  # prefix caching: state at block ends
                blocks = full_tables[plan.bnd_seq, plan.bnd_logical]
                st.bnd_kv.index_copy_(0, blocks, kvb[plan.bnd_blk, :, :hd])
                st.bnd_gate.index_copy_(0, blocks, gb[plan.bnd_blk, :, :hd])
            st.prev_kv.index_copy_(0, plan.upd_slot, kvb[plan.upd_blk, :, :hd])
            st.prev_gate.index_copy_(0, plan.upd_slot, gb[plan.upd_blk, :, :hd])
            st.has_prev.index_fill_(0, plan.upd_slot, True)
    st.pend_kv.view(-1, C).index_copy_(0, plan.pend_dst, kv[plan.pend_row].to(st.pend_kv.dtype))
    st.pend_gate.view(-1, C).index_copy_(0, plan.pend_dst, gate[plan.pend_row].to(st.pend_gate.dtype))
    return closed


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Lightning indexer: sum_h w[t,h] * relu(q[t,h] . k[s]) * head_dim^-0.5.
    q [n, Hi, d], keys [E, d], weights [n, Hi] (already scaled by Hi^-0.5) -> [n, E] fp32."""
    s = over_k(partial(torch.einsum, "nhd,ed->nhe"), q.float(), keys.float(), -1, -1)
    s = F.relu(s) * head_dim**-0.5
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


# --- paged attention over the hybrid cache ----------------------------------------------------

def _entry_slots(table: torch.Tensor, per_block: int, entries: torch.Tensor) -> torch.Tensor:
    return table[entries // per_block] * per_block + entries % per_block


def _scaled_head_weights(iw: torch.Tensor, iw_scale: float) -> torch.Tensor:
    """The indexer's head weights in fp32 times their scale, as the model computed them before the
    fused kernel took the scale."""
    return iw if iw_scale == 1.0 else iw.float() * iw_scale


def indexer_scores_paged(iq: torch.Tensor, iw: torch.Tensor, index_pool: torch.Tensor, full_tables: torch.Tensor,
                         positions: torch.Tensor, token_seq: torch.Tensor, ratio: int, n_max: int,
                         iw_scale: float = 1.0) -> torch.Tensor:
    """The indexer's scores of each query token (one row per sequence, a decode batch) over the first
    n_max entries of its sequence's paged index keys -> [T, n_max] fp32, -inf where the entry is not
    visible yet ((e + 1) * ratio > pos + 1). iw: the head weights before their scale iw_scale."""
    iw = _scaled_head_weights(iw, iw_scale)
    per_block, d = index_pool.shape[1], index_pool.shape[-1]
    e = torch.arange(n_max, device=iq.device)
    keys = index_pool.view(-1, d)[full_tables[token_seq][:, e // per_block] * per_block + e % per_block]  # [T, n, d]
    s = over_k(partial(torch.einsum, "thd,ted->the"), iq.float(), keys.float(), -1, -1)
    scores = (torch.relu(s) * d**-0.5 * iw.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(e[None] >= ((positions + 1) // ratio)[:, None], float("-inf"))


def topk_by_score_then_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best fp32 scores per row, best first, an exact tie to the lower index (-0.0 as
    +0.0). torch.topk breaks ties by its own algorithm, which on CPU depends on the row's length, so a
    sequence padded to a batch's longest row could pick another of the tied entries than alone (the
    relu in the indexer's score makes exact 0.0 ties common). One int64 key per entry, the score's
    bits made order-preserving above the reversed index: the fused sort kernel's order exactly."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # IEEE order as signed integers
    n = scores.shape[-1]
    packed = (key << 32) | (n - 1 - torch.arange(n, device=scores.device))
    return n - 1 - (packed.topk(k, dim=-1).values & 0xFFFFFFFF)


def indexer_topk(iq: torch.Tensor, iw: torch.Tensor, index_pool: torch.Tensor, full_tables: torch.Tensor,
                 positions: torch.Tensor, token_seq: torch.Tensor, ratio: int, topk: int,
                 max_pos: int | None = None, one_per_seq: bool = False, iw_scale: float = 1.0) -> torch.Tensor:
    """Lightning indexer selection per query token: indices [T, topk] of the compressed entries to
    attend, best first (an exact tie: the lower index), then -1 where fewer are visible (the fused
    attention relies on that order). A query at i sees entry e once its block is complete:
    (e + 1) * ratio <= i + 1.
    one_per_seq (decode): all sequences at once, padded to the largest, no host sync. iw: the head
    weights [T, Hi] before their scale iw_scale (V4: Hi^-0.5), which the fused kernel applies in fp32."""
    iw = _scaled_head_weights(iw, iw_scale)
    T, per_block, d = iq.shape[0], index_pool.shape[1], index_pool.shape[-1]
    out = torch.full((T, topk), -1, dtype=torch.long, device=iq.device)
    flat = index_pool.view(-1, d)
    if one_per_seq:
        n = (max_pos + 1) // ratio
        if n == 0:
            return out
        scores = indexer_scores_paged(iq, iw, index_pool, full_tables, positions, token_seq, ratio, n)
        limit = ((positions + 1) // ratio)[:, None]
        k = min(topk, n)
        idx = topk_by_score_then_index(scores, k)
        out[:, :k] = torch.where(idx < limit, idx, -1)
        return out
    for s in torch.unique(token_seq).tolist():
        rows = (token_seq == s).nonzero().flatten()
        pos = positions[rows]
        n = int(pos.max().item() + 1) // ratio
        if n == 0:
            continue
        keys = flat[_entry_slots(full_tables[s], per_block, torch.arange(n, device=iq.device))]
        scores = indexer_scores(iq[rows], keys, iw[rows], d)
        visible = torch.arange(n, device=iq.device)[None] < ((pos + 1) // ratio)[:, None]
        k = min(topk, n)
        idx = topk_by_score_then_index(scores.masked_fill(~visible, float("-inf")), k)
        ok = idx < ((pos + 1) // ratio)[:, None]
        out[rows, :k] = torch.where(ok, idx, torch.full_like(idx, -1))
    return out


def paged_attention(q: torch.Tensor, positions: torch.Tensor, token_seq: torch.Tensor, window_pool: torch.Tensor,
                    window_tables: torch.Tensor, replay_starts: torch.Tensor, sliding_window: int,
                    comp_pool: torch.Tensor | None, full_tables: torch.Tensor | None, ratio: int,
                    selected: torch.Tensor | None, sinks: torch.Tensor, scale: float,
                    inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Shared-KV attention for packed query tokens over the paged caches: the sliding window
    (positions (i - W, i], none below the sequence's replay_start) plus, on compressed layers,
    every complete entry (HCA, selected=None) or the indexer's selection (CSA). -> [T, H, d];
    inv_rope (cos, sin): then apply_rope(out, cos, sin) (V4 undoes RoPE on the value's rope slice)."""
    out = torch.empty_like(q)
    bs, d = window_pool.shape[1], q.shape[-1]
    wflat = window_pool.view(-1, d)
    for s in torch.unique(token_seq).tolist():
        rows = (token_seq == s).nonzero().flatten()
        pos = positions[rows]
        lo = max(0, int(pos.min()) - sliding_window + 1, int(replay_starts[s]))
        hi = int(pos.max()) + 1
        kpos = torch.arange(lo, hi, device=q.device)
        keys = wflat[window_tables[s][kpos // bs] * bs + kpos % bs]
        allowed = (kpos[None] <= pos[:, None]) & (kpos[None] > pos[:, None] - sliding_window)
        if comp_pool is not None:
            per_block = comp_pool.shape[1]
            n = hi // ratio
            comp = comp_pool.view(-1, d)[_entry_slots(full_tables[s], per_block, torch.arange(n, device=q.device))]
            visible = torch.arange(n, device=q.device)[None] < ((pos + 1) // ratio)[:, None]
            if selected is not None:
                sel = selected[rows]
                chosen = torch.zeros((len(rows), n + 1), dtype=torch.bool, device=q.device)
                chosen.scatter_(1, torch.where(sel >= 0, sel, n), True)
                visible = visible & chosen[:, :n]
            keys = torch.cat([keys, comp])
            allowed = torch.cat([allowed, visible], dim=1)
        out[rows] = sink_attention(q[rows], keys, allowed, sinks, scale)
    return out if inv_rope is None else apply_rope(out, *inv_rope)


# --- sampling ---------------------------------------------------------------------------------

def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, V] fp32 -> [3, n] float64: argmax (first on ties), its logprob, log-sum-exp."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    mx, idx = logits.float().max(dim=-1)
    return torch.stack([idx.double(), (mx - lse).double(), lse.double()])


# --- drawing a sampled token (engine/sampler.py) -------------------------------------------------------------------
_FMAX = torch.finfo(torch.float32).max


def finite_logits(x: torch.Tensor) -> torch.Tensor:
    """NaN is never picked; +inf (overflow) becomes the largest float, -inf (masked) stays."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=_FMAX, neginf=float("-inf"))


def sample_filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sampled row may draw, vLLM's options in vLLM's order, rows [n, V]: (d, keep), d = y - max(y) in float32
    for y = logits / temperature, keep the tokens left after min_p (keep y's probability >= min_p x the top one's),
    top-k (the k largest; ties with the k-th stay) and top-p (the largest tokens whose probability strictly above
    them, among those left, is below top_p: ties go together; the top token always stays). top_k: [n] in 1..V (V:
    off); top_p: [n] in (0, 1] (1: off); min_p: [n] (0: off); None: off for every row. Sums are float64."""
    y = finite_logits(finite_logits(logits.float()) / temperature[:, None])
    top = y.amax(-1, keepdim=True)
    d = torch.where(top > float("-inf"), y - top, float("-inf"))  # a row with nothing finite keeps nothing
    e = d.exp()
    keep = d > float("-inf")
    if min_p is not None:
        keep &= e >= min_p[:, None]
    if top_k is None and top_p is None:
        return d, keep
    ordered = d.masked_fill(~keep, float("-inf")).sort(-1, descending=True).values  # one sort serves both
    if top_k is not None:  # fewer left than k: the k-th is -inf, nothing more goes
        kth = ordered.gather(1, (top_k.long() - 1).clamp(0, d.shape[-1] - 1)[:, None])
        keep &= d >= kth
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # still in order: what top-k dropped is its tail
    if top_p is not None:
        w = ordered.exp().double()
        above = w.cumsum(-1) - w  # the mass strictly above each entry in this order: a tie's first entry's
        within = (above < top_p.double()[:, None] * w.sum(-1, keepdim=True)) | (top_p[:, None] >= 1)
        last = (within.sum(-1, keepdim=True) - 1).clamp(min=0)
        keep &= d >= ordered.gather(1, last)
    return d, keep


def sample_draw(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of logits [n, V] drawn after sample_filter (each option [w] for those rows) by the inverse of their
    cumulative distribution in token order at u [w] in [0, 1) (float64): the first token whose kept mass up to it
    (float64) exceeds u x the row's kept mass. [w] int64; -1 where nothing is left to draw."""
    d, keep = sample_filter(logits[rows], temperature, top_k, top_p, min_p)
    w = torch.where(keep, d.exp(), 0).double()
    cum = w.cumsum(-1)
    total = cum[:, -1]
    token = (cum <= (u.double() * total)[:, None]).sum(-1)  # the first entry past the target
    last_kept = torch.where(keep, torch.arange(d.shape[-1], device=d.device), -1).amax(-1)
    token = torch.minimum(token, last_kept)  # a target rounded up to the total
    return torch.where(total > 0, token, -1)
