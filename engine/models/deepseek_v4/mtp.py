"""DeepSeek-V4's multi-token-prediction layer (`mtp.0.*`), the draft of speculative decoding.

At position i it reads the main model's last residual streams h_i ([hc_mult, hidden], before
the HC head and the final norm: what vLLM's DeepSeekV4MTP is fed) and the embedding of the
next token t_{i+1}, and predicts t_{i+2}:

    x_i = h_proj(hnorm(h_i)) + e_proj(enorm(embed(t_{i+1})))   (e_proj broadcast over the copies)
    h'_i = Block(x_i)                    one V4 block with its own mHC (attention: sliding window)
    logits = head(norm(hc_head'(h'_i)))  its own HC head and norm, the main model's LM head

DeepSeek describes the projection as M[RMSNorm(h); RMSNorm(Emb(t))] on the concatenation (V3
report, eq. 21); V4 checkpoints store the two halves of M as `h_proj` and `e_proj`, which is the
same map. The embedding at position 0 is zeroed (vLLM's masking: no token precedes it). Chained
drafts re-feed h'_i (pre-HC-head) as the next step's h. docs/SPEC_DECODE.md has the details.

The block keeps its window KV in its own one-layer KVCache whose window pool has the main
cache's shape, so it is addressed by the main cache's window block tables and freed with them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import kernels as K
from engine.cache import KVCache
from engine.forward_batch import ForwardBatch
from engine.models.config import SLIDING
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.deepseek_v4.model import (
    Block,
    DeepseekV4,
    Linear,
    Norm,
    cast_params,
    expected_names,
    load_weight,
)
from engine.models.stacked_linears import stack_linears
from engine.models.weights import WeightsError

PREFIX = "mtp.0."


def mtp_config(cfg: ModelConfig, hashed: bool) -> ModelConfig:
    """The MTP block as layer 0 of a one-layer model: sliding window, routed (or hash) MoE."""
    return dataclasses.replace(cfg, num_layers=1, compress_ratios=(0,), layer_types=(SLIDING,),
                               num_hash_layers=1 if hashed else 0)


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig, quantized: bool = False, hashed: bool = False):
        super().__init__()
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.cfg = mtp_config(cfg, hashed)
        fp8 = quantized and cfg.fp8_linears
        self.enorm, self.hnorm, self.norm = Norm(D, cfg.rms_norm_eps), Norm(D, cfg.rms_norm_eps), Norm(D, cfg.rms_norm_eps)
        self.e_proj, self.h_proj = Linear(D, D, fp8), Linear(D, D, fp8)
        self.block = Block(self.cfg, 0, quantized)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    @classmethod
    def from_model(cls, model: DeepseekV4) -> MTP:
        """Build from the `mtp.0.*` tensors the loader kept (model.mtp_weights), which move here."""
        w = {k[len(PREFIX):]: v for k, v in model.mtp_weights.items() if k.startswith(PREFIX)}
        if not w:
            raise WeightsError("speculative_config method 'mtp' needs the checkpoint's MTP layer (mtp.0.*); "
                               "this checkpoint has none")
        if any(k.startswith("attn.compressor.") for k in w):
            raise WeightsError("the MTP layer has a compressor (its compress_ratios slot is not 0); "
                               "only a sliding-window MTP block is supported")
        dev = model.embed.weight.device
        with torch.device("meta"):
            mtp = cls(model.cfg, model.quantized, hashed="ffn.gate.tid2eid" in w)
        mtp.to_empty(device=dev)
        cast_params(mtp, model.embed.weight.dtype)
        names = {("block." + k if k.startswith(("attn", "ffn", "hc_attn", "hc_ffn")) else k): v for k, v in w.items()}
        expected = expected_names(mtp, model.cfg.n_routed_experts)
        if set(names) != expected:
            raise WeightsError(f"MTP layer does not match the config: missing {sorted(expected - set(names))[:8]} "
                               f"unexpected {sorted(set(names) - expected)[:8]}")
        for name, t in names.items():
            load_weight(mtp, name, t.to(dev))
        for k in [k for k in model.mtp_weights if k.startswith(PREFIX)]:
            del model.mtp_weights[k]  # one copy on the device
        stack_linears(mtp)  # its block's FP8 pairs in one launch each, as the main model's
        return mtp.eval()

    def make_cache(self, main: KVCache) -> KVCache:
        """Window KV for the MTP block, indexed like the main cache's window pool."""
        return KVCache(self.cfg, main.block_size, main.scratch_window, main.scratch_full, main.max_num_seqs,
                       main.dtype, main.device)

    @torch.inference_mode()
    def forward(self, model: DeepseekV4, fb: ForwardBatch, cache: KVCache, prev_hidden: torch.Tensor) -> torch.Tensor:
        """fb: the MTP's batch (input_ids = the next tokens t_{i+1}, positions i); prev_hidden
        [T, hc_mult, D]: the main model's (or the previous draft's) residual streams at i.
        Returns this layer's residual streams [T, hc_mult, D] (before its HC head)."""
        e = model.embed(fb.input_ids)
        e = torch.where((fb.positions == 0)[:, None], torch.zeros_like(e), e)
        T, hc, D = prev_hidden.shape
        h = self.h_proj(self.hnorm(prev_hidden.to(e.dtype)).view(T * hc, D)).view(T, hc, D)
        x = h + self.e_proj(self.enorm(e)).unsqueeze(1)
        return self.block(x, fb, cache, model.ropes(fb.positions, e.dtype))

    @torch.inference_mode()
    def compute_logits(self, model: DeepseekV4, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = K.hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps)
        return F.linear(self.norm(x), model.head.weight).float()
