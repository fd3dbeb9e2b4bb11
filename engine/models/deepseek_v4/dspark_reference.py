"""A float torch reference of the DSpark drafter for one sequence, written from the published
descriptions (docs/DSPARK.md names them): plain tensors, no cache, no batching. It is the spec
the engine's DSpark path is checked against, one piece per function:

  main_context       stage 0's projection of the target features: main_norm(main_proj(f))
  attention_allowed  the block's attention mask: every block query sees the last `window` context
                     positions (their main-context KV) and the whole block (bidirectional)
  stage_forward      one draft stage: a V4 block (mHC, MoE) whose attention reads that mask
  markov_draft       the low-rank Markov head, sequential: the bias of position i comes from the
                     token drafted at i - 1 (the block's real first token for i = 0)
  confidence_logits  the confidence head on [hidden ; markov embedding] of each position
  verify_length      the confidence head's choice: the longest prefix whose predicted
                     probability of being accepted whole stays at or above the threshold
  draft_block        the whole drafter: block input, the stages in order, HC head, norm, LM head,
                     Markov head, confidence head

Positions: the target has verified tokens up to position t + 1 (x_{t+1}, its last token, sampled
from the target's output at position t); the context is positions 0..t, whose target features
the drafter reads; the block sits at positions t+1 .. t+B with inputs [x_{t+1}, noise, ..., noise]
and drafts x_{t+2} .. x_{t+B+1}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference as R


@dataclass(frozen=True)
class DraftBlock:
    tokens: list[int]  # the B drafted tokens x_{t+2} .. x_{t+B+1}
    logits: torch.Tensor  # [B, vocab] fp32 (float64 in float64 runs), the Markov bias added
    confidence: torch.Tensor  # [B] the confidence head's logits
    verify_len: int  # how many of the drafts to verify (1..B)


def main_context(drafter, features: torch.Tensor) -> torch.Tensor:
    """Target features [T, n_targets * D] (DeepseekV4.dspark_features) -> main context [T, D]."""
    x = R.linear(features, drafter.main_proj.weight, drafter.main_proj.scale)
    return R.rms_norm(x, drafter.main_norm.weight, drafter.cfg.rms_norm_eps)


def attention_allowed(block_start: int, block_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of a block at positions block_start .. block_start + B - 1 and which of them each
    block query may read: (context key positions [n], allowed [B, n + B]). The context keys are
    the last `window` positions before the block (fewer near the start); the block's own keys
    follow, all visible to every block query (the block is drafted at once, not causally)."""
    first = max(0, block_start - window)
    context = torch.arange(first, block_start)
    return context, torch.ones(block_size, len(context) + block_size, dtype=torch.bool)


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    cos, sin = R.rope_cos_sin(positions, inv_freq, x.dtype)
    return R.apply_rope(x, cos, -sin if inverse else sin)


def stage_attention(attn, cfg, x: torch.Tensor, main_x: torch.Tensor, block_start: int,
                    inv_freq: torch.Tensor) -> torch.Tensor:
    """DSpark attention of one stage. x [B, D]: the block's normed input; main_x [T, D]: the main
    context of positions 0..T-1 (T = block_start), projected to KV by this stage's own wkv / kv_norm
    without the block's norms (the context rows are not run through the block)."""
    B, H, hd, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    context, allowed = attention_allowed(block_start, B, cfg.sliding_window)
    block_pos = torch.arange(block_start, block_start + B)

    def kv_of(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return _rope(R.rms_norm(R.linear(rows, attn.wkv.weight, attn.wkv.scale), attn.kv_norm.weight, eps), pos, inv_freq)

    kv = torch.cat([kv_of(main_x[context], context), kv_of(x, block_pos)])
    q = R.linear(R.rms_norm(R.linear(x, attn.wq_a.weight, attn.wq_a.scale), attn.q_norm.weight, eps),
                 attn.wq_b.weight, attn.wq_b.scale).view(B, H, hd)
    q = _rope(R.rms_norm_unweighted(q, eps), block_pos, inv_freq)
    out = R.sink_attention(q, kv, allowed, attn.attn_sink, hd**-0.5)
    out = _rope(out, block_pos, inv_freq, inverse=True)  # K = V: undo RoPE on the value's rope slice
    groups = cfg.o_groups
    o = R.grouped_linear(out.reshape(B, groups, -1), attn.wo_a.weight, groups, attn.wo_a.scale)
    return R.linear(o, attn.wo_b.weight, attn.wo_b.scale)


def _moe(ffn, cfg, x: torch.Tensor) -> torch.Tensor:
    weights, indices = R.router_topk(x, ffn.gate.weight, ffn.gate.bias, cfg.num_experts_per_tok,
                                     cfg.routed_scaling_factor, cfg.scoring_func)
    scales = None if ffn.experts_w1_scale is None else (ffn.experts_w1_scale, ffn.experts_w3_scale,
                                                        ffn.experts_w2_scale)
    routed = R.moe_experts(x, ffn.experts_w1, ffn.experts_w3, ffn.experts_w2, weights, indices, cfg.swiglu_limit, scales)
    s = ffn.shared_experts
    shared = R.linear(R.swiglu(R.linear(x, s.w1.weight, s.w1.scale), R.linear(x, s.w3.weight, s.w3.scale),
                               cfg.swiglu_limit), s.w2.weight, s.w2.scale)
    return routed + shared


def stage_forward(block, cfg, h: torch.Tensor, main_x: torch.Tensor, block_start: int,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """One draft stage on the block's residual streams h [B, hc, D]: mHC around DSpark attention and the MoE."""
    args = (cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters)
    post, comb, x = R.hc_pre(h, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, *args)
    x = R.rms_norm(x, block.attn_norm.weight, cfg.rms_norm_eps)
    h = R.hc_post(h, stage_attention(block.attn, cfg, x, main_x, block_start, inv_freq), post, comb)
    post, comb, x = R.hc_pre(h, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, *args)
    x = R.rms_norm(x, block.ffn_norm.weight, cfg.rms_norm_eps)
    return R.hc_post(h, _moe(block.ffn, cfg, x), post, comb)


def markov_draft(logits: torch.Tensor, first_prev: int, w1: torch.Tensor, w2: torch.Tensor,
                 pick: Callable[[torch.Tensor], int] = lambda row: int(row.argmax())):
    """The Markov head over a block's logits [B, V]: position i gets the bias w2 @ w1[prev_i]
    where prev_0 = first_prev (the block's real token) and prev_i = the token drafted at i - 1,
    then picks its token (greedy by default; a sampler for temperature > 0).
    -> (tokens [B], biased logits [B, V] in fp32 or wider, Markov embeddings [B, rank])."""
    out = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()  # fp32 or wider
    embeds, tokens, prev = [], [], first_prev
    for i in range(out.shape[0]):
        e = w1[prev]
        out[i] += F.linear(e, w2).to(out.dtype)
        embeds.append(e)
        prev = pick(out[i])
        tokens.append(prev)
    return tokens, out, torch.stack(embeds)


def confidence_logits(proj: torch.Tensor, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
    """proj [1, D + rank] on [hidden_i ; markov_embed_i] per position -> [B] logits (sigmoid: the
    predicted probability that draft i is accepted given the ones before it were)."""
    x = torch.cat([hidden, markov_embeds.to(hidden.dtype)], dim=-1)
    return F.linear(x.to(proj.dtype), proj).squeeze(-1)


def verify_length(confidence: torch.Tensor, threshold: float) -> int:
    """The longest prefix L (at least 1) with prod_{i < L} sigmoid(confidence_i) >= threshold:
    threshold 0 verifies the whole block, threshold 1 only the first draft."""
    survive = torch.cumprod(torch.sigmoid(confidence.double()), dim=0)
    return max(1, int((survive >= threshold).sum()))


@torch.inference_mode()
def draft_block(model, drafter, features: torch.Tensor, last_token: int, threshold: float = 0.0,
                pick: Callable[[torch.Tensor], int] | None = None) -> DraftBlock:
    """The drafter for one sequence. features [t + 1, n_targets * D]: the target features of
    context positions 0..t; last_token: x_{t+1}. The stages run in order on the block's streams."""
    cfg, d = drafter.cfg, drafter.cfg.dspark
    t1, B = features.shape[0], d.block_size
    main_x = main_context(drafter, features)
    ids = torch.tensor([last_token] + [d.noise_token_id] * (B - 1))
    x = model.embed.weight[ids]
    h = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for block in drafter.stages:
        h = stage_forward(block, drafter.stage_cfg, h, main_x, t1, model.main_inv_freq)
    hidden = R.hc_head(h, drafter.hc_head_fn, drafter.hc_head_base, drafter.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
    logits = R.linear(R.rms_norm(hidden, drafter.norm.weight, cfg.rms_norm_eps), model.head.weight)
    mk = drafter.markov_head
    kw = {} if pick is None else {"pick": pick}
    tokens, logits, embeds = markov_draft(logits, last_token, mk.markov_w1.weight, mk.markov_w2.weight, **kw)
    conf = confidence_logits(drafter.confidence_head.proj.weight, hidden, embeds)
    return DraftBlock(tokens, logits, conf, verify_length(conf, threshold))
