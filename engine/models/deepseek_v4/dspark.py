"""DeepSeek-V4-Flash-0731's DSpark draft stages (`mtp.0..`, docs/DSPARK.md): the module that holds
them, the map from checkpoint names to it, and the load-time check of the section.

Checkpoint layout (S = num_stages, 3 in 0731; L = S - 1):
  mtp.J.<block tensors>            every stage: one sliding-window V4 block (attention, routed MoE
                                   with a shared expert, mHC), stored as the main layers are
  mtp.0.main_proj / main_norm      stage 0: the concatenated target-layer streams -> hidden
  mtp.L.norm, mtp.L.hc_head_*      the last stage: the drafter's HC head and final norm
  mtp.L.markov_head.markov_w1/w2   the low-rank Markov head ([vocab, rank] each)
  mtp.L.confidence_head.proj       the confidence head ([1, hidden + rank], no bias)
Here the stages are `stages.J.*` and the single-owner extras drop their `mtp.J.` prefix.

`DSparkDrafter` is the engine's drafter: a batch of sequences' blocks at once, on the `kernels` ops,
in fixed shapes (each block's window of context keys padded and masked, one batched attention):
`draft_from_ring` reads every stage's keys from the proposer's key ring (engine/spec/dspark.py),
which `write_context` fills, and is what the CUDA graphs capture (engine/spec/dspark_graphs.py);
`draft` takes per-sequence contexts (main-context rows or keys). engine/models/deepseek_v4/
dspark_reference.py is its one-sequence torch reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels as K
from engine.models.config import SLIDING
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.model import (
    Block,
    DeepseekV4,
    Linear,
    Norm,
    cast_params,
    check_weight,
    expected_names,
    load_weight,
    weight_target,
)
from engine.models.weights import WeightsError

PREFIX = "mtp."
_BLOCK = ("attn", "ffn", "hc_attn", "hc_ffn")  # what a stage's Block holds (attn_norm / ffn_norm included)
_FIRST = ("main_proj.", "main_norm.")
_LAST = ("norm.", "hc_head_", "markov_head.", "confidence_head.")
FP32 = ("hc_", "attn_sink", ".ape", "gate.bias", "norm.weight", "q_norm", "kv_norm", "confidence_head")


def stage_config(cfg: ModelConfig) -> ModelConfig:
    """A draft stage as layer 0 of a one-layer model: sliding window, routed MoE with the stages' experts."""
    d = cfg.dspark
    return dataclasses.replace(cfg, num_layers=1, compress_ratios=(0,), layer_types=(SLIDING,), num_hash_layers=0,
                               n_routed_experts=d.n_routed_experts, num_experts_per_tok=d.num_experts_per_tok,
                               dspark=None)


class MarkovHead(nn.Module):
    """Low-rank bigram correction: logits bias = markov_w2 @ markov_w1[previous token]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False)


@dataclass(frozen=True)
class Drafts:
    tokens: torch.Tensor  # [S, B] the drafted tokens of each sequence's block
    confidence: torch.Tensor  # [S, B] the confidence head's logits
    verify_len: torch.Tensor  # [S] long, on the device: how many drafts to verify (1..B)


def verify_lengths(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per row: the longest prefix (at least 1) whose predicted probability of being accepted whole,
    prod sigmoid(confidence_i), stays >= threshold (docs/DSPARK.md: our reading of the head). On the
    device: a CUDA graph's replay leaves it beside the drafts, read back with them."""
    survive = torch.cumprod(torch.sigmoid(confidence.double()), dim=-1)
    return (survive >= threshold).sum(-1).clamp(min=1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: bool = False):
        super().__init__()
        if cfg.dspark is None:
            raise ValueError("DSparkDrafter needs a config with dspark_* keys (the 0731 layout)")
        d, D, hc = cfg.dspark, cfg.hidden_size, cfg.hc_mult
        self.cfg, self.stage_cfg = cfg, stage_config(cfg)
        fp8 = quantized and cfg.fp8_linears
        self.stages = nn.ModuleList(Block(self.stage_cfg, 0, quantized) for _ in range(d.num_stages))
        self.main_proj = Linear(D, len(d.target_layer_ids) * D, fp8)
        self.main_norm = Norm(D, cfg.rms_norm_eps)
        self.norm = Norm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.markov_head = MarkovHead(cfg.vocab_size, d.markov_rank)
        self.confidence_head = ConfidenceHead(D, d.markov_rank)

    def expected_names(self) -> set[str]:
        return expected_names(self, self.cfg.dspark.n_routed_experts)

    def main_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, n_targets * D] -> the main context [T, D] every stage reads as KV."""
        return self.main_norm(self.main_proj(features))

    @torch.inference_mode()
    def context_kv(self, model: DeepseekV4, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Main context rows [T, D] at `positions` -> every stage's keys for them [T, stages, head_dim]:
        its wkv, kv_norm and RoPE at the context position. They depend on nothing else, so a
        sequence's rows are computed once, when its features arrive (DSparkProposer keeps them)."""
        x = main_x.to(model.embed.weight.dtype)
        cos, sin = K.rope_cos_sin(positions.to(x.device), model.main_inv_freq, x.dtype)
        eps = self.cfg.rms_norm_eps
        return torch.stack([K.norm_rope(b.attn.wkv(x), b.attn.kv_norm.weight, cos, sin, eps) for b in self.stages], 1)

    @torch.inference_mode()
    def write_context(self, model: DeepseekV4, ring: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      rows: torch.Tensor) -> None:
        """Every stage's keys of target features [T, n_targets * D] at `positions` [T] into `ring`
        [slots * window, stages, head_dim] at `rows` [T] (DSparkProposer's key ring)."""
        ring.index_copy_(0, rows, self.context_kv(model, self.main_context(features), positions).to(ring.dtype))

    @torch.inference_mode()
    def draft_from_ring(self, model: DeepseekV4, ring: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                        last_tokens: torch.Tensor, threshold: float) -> Drafts:
        """Each row's block from the keys in `ring` (DSparkProposer's: slot s holds position p at row
        s * window + p % window): the block at positions starts[i].. reads slot slots[i]'s last
        `window` positions before it (fewer near the start: masked). Fixed shapes, no host reads:
        what a CUDA graph captures."""
        W = self.cfg.sliding_window
        ctx_pos = starts[:, None] - W + torch.arange(W, device=starts.device)  # ascending, as draft() orders them
        keys = ring[slots[:, None] * W + ctx_pos % W]
        return self._draft(model, keys, ctx_pos >= 0, starts, last_tokens, threshold)

    @torch.inference_mode()
    def draft(self, model: DeepseekV4, contexts: list[tuple[torch.Tensor, torch.Tensor]], last_tokens: list[int],
              threshold: float) -> Drafts:
        """Each sequence's block, drafted greedily. contexts: per sequence (its context, their
        positions [n]: the last sliding_window positions before the block, ascending), the context
        either main context rows [n, D] (their keys computed here) or every stage's keys
        [n, stages, head_dim] (context_kv, computed earlier); last_tokens: each block's real first
        token, at the position after its context. The contexts are padded to the longest (masked)."""
        dev, S = self.main_norm.weight.device, len(last_tokens)
        keys = [c if c.dim() == 3 else self.context_kv(model, c, p) for c, p in contexts]
        n = max(len(k) for k in keys)
        ctx = keys[0].new_zeros(S, n, *keys[0].shape[1:])
        mask = torch.zeros(S, n, dtype=torch.bool, device=dev)
        for s, k in enumerate(keys):  # padding first: the context's positions stay ascending
            ctx[s, n - len(k):] = k
            mask[s, n - len(k):] = True
        starts = torch.tensor([int(p[-1]) + 1 if len(p) else 0 for _, p in contexts], device=dev)
        return self._draft(model, ctx, mask, starts, torch.tensor(last_tokens, device=dev), threshold)

    def _draft(self, model: DeepseekV4, ctx_kv: torch.Tensor, ctx_mask: torch.Tensor, starts: torch.Tensor,
               last_tokens: torch.Tensor, threshold: float) -> Drafts:
        """The drafter on fixed shapes. ctx_kv [S, n, stages, head_dim]: each block's context keys,
        ctx_mask [S, n] which of them exist; starts [S]: each block's first position; last_tokens
        [S]: its real first token."""
        cfg, d = self.cfg, self.cfg.dspark
        S, B, hc, eps = len(last_tokens), d.block_size, cfg.hc_mult, cfg.rms_norm_eps
        ids = torch.cat([last_tokens[:, None], last_tokens.new_full((S, B - 1), d.noise_token_id)], 1).view(-1)
        block_pos = (starts[:, None] + torch.arange(B, device=starts.device)).view(-1)
        x = model.embed(ids)
        rope = K.rope_cos_sin(block_pos, model.main_inv_freq, x.dtype)
        ctx_kv = ctx_kv.to(x.dtype)
        h = x.unsqueeze(1).expand(-1, hc, -1).contiguous()
        sc = self.stage_cfg
        for j, block in enumerate(self.stages):
            post, comb, xa = K.hc_pre(h, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, sc.hc_eps, eps,
                                      sc.hc_sinkhorn_iters)
            h = K.hc_post(h, self._attention(block.attn, block.attn_norm(xa), ctx_kv[:, :, j], ctx_mask, rope),
                          post, comb)
            post, comb, xf = K.hc_pre(h, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, sc.hc_eps, eps,
                                      sc.hc_sinkhorn_iters)
            h = K.hc_post(h, block.ffn(block.ffn_norm(xf), ids), post, comb)
        hidden = K.hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, eps)
        logits = F.linear(self.norm(hidden), model.head.weight).view(S, B, -1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        w1, w2 = self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight
        prev, tokens, embeds = last_tokens, [], []
        for i in range(B):  # sequential: position i is biased by the token drafted at i - 1
            e = w1[prev]
            prev = (logits[:, i] + F.linear(e, w2).to(logits.dtype)).argmax(-1)
            tokens.append(prev)
            embeds.append(e)
        markov = torch.stack(embeds, dim=1).view(S * B, -1)
        proj = self.confidence_head.proj.weight
        conf = F.linear(torch.cat([hidden, markov.to(hidden.dtype)], -1).to(proj.dtype), proj).view(S, B)
        return Drafts(torch.stack(tokens, dim=1), conf, verify_lengths(conf, threshold))

    def _attention(self, attn, x: torch.Tensor, ctx_kv: torch.Tensor, ctx_mask: torch.Tensor, rope):
        """DSpark attention for S blocks of B rows in one batched call: each reads its own context's
        keys (this stage's, ctx_kv [S, n, head_dim], where ctx_mask [S, n]) and its whole block."""
        cfg, (S, n) = self.stage_cfg, ctx_mask.shape
        B, H, hd, eps = self.cfg.dspark.block_size, cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        q = K.norm_rope(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(-1, H, hd), None, *rope, eps)
        kv = K.norm_rope(attn.wkv(x), attn.kv_norm.weight, *rope, eps)
        keys = torch.cat([ctx_kv, kv.view(S, B, hd)], 1)
        allowed = torch.cat([ctx_mask, ctx_mask.new_ones(S, B)], 1)[:, None].expand(S, B, n + B)  # window + the block
        out = K.sink_attention(q.view(S, B, H, hd), keys, allowed, attn.attn_sink, hd**-0.5).view(S * B, H, hd)
        out = K.apply_rope(out, rope[0], -rope[1])  # K = V: undo RoPE on the value's rope slice
        o = K.grouped_linear(out.view(out.shape[0], cfg.o_groups, -1), attn.wo_a.weight, cfg.o_groups, attn.wo_a.scale)
        return attn.wo_b(o)

    @classmethod
    def from_model(cls, model: DeepseekV4) -> DSparkDrafter:
        """Build from the `mtp.*` tensors the loader kept and checked (model.mtp_weights), which move here."""
        cfg = model.cfg
        if cfg.dspark is None:
            raise WeightsError("speculative_config method 'dspark' needs DSpark draft stages (the 0731 layout: "
                               "dspark_* config keys); this checkpoint has none")
        check_dspark_section(cfg, model.mtp_weights, model.quantized)
        dev = model.embed.weight.device
        with torch.device("meta"):
            drafter = cls(cfg, model.quantized)
        drafter.to_empty(device=dev)
        cast_params(drafter, model.embed.weight.dtype, FP32)
        for name in list(model.mtp_weights):
            load_weight(drafter, module_name(name, cfg.dspark.num_stages), model.mtp_weights.pop(name).to(dev))
        return drafter.eval()


def module_name(name: str, num_stages: int) -> str | None:
    """`mtp.J.<rest>` -> this module's name for it; None when no stage J holds `<rest>` (a tensor
    in the wrong stage, or a stage the config does not have)."""
    if not name.startswith(PREFIX):
        return None
    head, _, rest = name[len(PREFIX):].partition(".")
    if not head.isdigit() or not rest:
        return None
    j = int(head)
    if j >= num_stages:
        return None
    if rest.startswith(_BLOCK):
        return f"stages.{j}.{rest}"
    if (j == 0 and rest.startswith(_FIRST)) or (j == num_stages - 1 and rest.startswith(_LAST)):
        return rest
    return None


def check_dspark_section(cfg: ModelConfig, weights: dict[str, torch.Tensor], quantized: bool) -> None:
    """Refuse a DSpark section that does not match the config, naming the tensor: missing, unexpected
    or misplaced names, shapes, stored FP8 / FP4 dtypes. Builds the drafter on the meta device (no memory)."""
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg, quantized)
    expected, seen, unexpected = drafter.expected_names(), set(), []
    for name, tensor in weights.items():
        mine = module_name(name, cfg.dspark.num_stages)
        if mine is None or mine not in expected:
            unexpected.append(name)
            continue
        check_weight(weight_target(drafter, mine), name, tensor)
        seen.add(mine)
    missing = sorted(expected - seen)
    if missing or unexpected:
        missing = [_checkpoint_name(m, cfg.dspark.num_stages) for m in missing]
        raise WeightsError(f"DSpark section (mtp.*) does not match the config ({cfg.dspark.num_stages} stages): "
                           f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                           f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")


def _checkpoint_name(mine: str, num_stages: int) -> str:
    """This module's name -> the checkpoint's (for messages)."""
    if mine.startswith("stages."):
        return PREFIX + mine[len("stages."):]
    return f"{PREFIX}{0 if mine.startswith(_FIRST) else num_stages - 1}.{mine}"
