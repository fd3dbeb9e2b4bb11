"""DeepSeek-V4.1 configuration: the released composite config.json (`text_config` nested) or the
flat text config, read once into `V41Config`. Checks the CSA2 schedule the way transformers'
DeepseekV41TextConfig does and refuses what this engine does not serve, naming the key.

Layer kinds by `compress_ratios[i]`: 0 sliding window only, r > 1 causal encoder pooling of r
tokens, 1 decoder latents (one per token). Only `kv_source_layer_ids` own a compressor; a later
layer with ratio > 0 reads the nearest source at or before it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ConfigError, DeepseekConfig, quantization, rope

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
V41_SLIDING, V41_SOURCE = "sliding_attention", "shared_compressed_attention"
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
RELEASED_KV_SOURCES = [2, 8, 14, 20]
RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]


@dataclass(frozen=True, kw_only=True)
class V41Config(DeepseekConfig):
    """DeepSeek-V4.1 on top of the common fields: router temperature, the CSA2 sources and the
    two-level top-k, Engram, the image token, FP8 tiles of its own size."""

    gate_temp: float
    norm_topk_prob: bool
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0: no two-level top-k
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    image_token_id: int | None
    weight_block_size: tuple[int, int] = (32, 32)

    model_type = "deepseek_v41"
    n_shared_experts = 1  # always one (parse_v41_config refuses others); engine/parallel.py slices it

    # --- the schedule, as the engine reads it ---------------------------------------------------

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(V41_SOURCE if i in self.kv_source_layer_ids else V41_SLIDING for i in range(self.num_layers))

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed KV `layer` attends (None: window only)."""
        if not self.compress_ratios[layer]:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    @property
    def last_kv_source(self) -> int:
        return max(self.kv_source_layer_ids) if self.kv_source_layer_ids else -1

    @property
    def compress_block_lcm(self) -> int:
        """A prefix-cache block must close a group of every source's compressor."""
        out = 1
        for s in self.kv_source_layer_ids:
            out = math.lcm(out, self.compress_ratios[s])
        return out


_IGNORED = {
    "architectures", "model_type", "transformers_version", "num_key_value_heads", "topk_method", "tie_word_embeddings",
    "num_nextn_predict_layers", "initializer_range", "hidden_act", "use_cache", "pad_token_id", "attention_bias",
    "attention_dropout", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "dtype",
    "torch_dtype", "n_shared_experts", "_name_or_path", "id2label", "label2id", "chunk_size_feed_forward",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "layer_types", "dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_noise_token_id",
    "dspark_num_experts_per_tok", "dspark_target_layer_ids", "auto_map", "generation_config", "expert_dtype",
    "quantization_config", "partial_rotary_factor",
}
_READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
    "routed_scaling_factor", "scoring_func", "gate_temp", "norm_topk_prob", "swiglu_limit", "sliding_window",
    "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "bos_token_id", "eos_token_id", "engram_layer_ids",
    "engram_vocab_size", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_id", "engram_compressed_vocab_size", "image_token_id",
}


def _text_config(raw: dict) -> tuple[dict, dict]:
    """(text config, outer config). The composite form nests the text config; the outer level
    carries image_token_id, vision_config and (released) quantization_config."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"config.json: model_type {raw.get('model_type')!r} is not one of {MODEL_TYPES}")
    if "text_config" in raw:
        text = dict(raw["text_config"])
        for key in ("quantization_config", "expert_dtype"):
            if key in raw and key not in text:
                text[key] = raw[key]
        return text, raw
    return dict(raw), {}


def _schedule(raw: dict, n: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    ratios = list(raw.get("compress_ratios") or (RELEASED_RATIOS if n == len(RELEASED_RATIOS) else []))
    if len(ratios) < n:
        raise ConfigError(f"config.json: compress_ratios needs num_hidden_layers={n} entries, got {len(ratios)}")
    if any(r != 0 for r in ratios[n:]):
        raise ConfigError("config.json: compress_ratios past num_hidden_layers (DSpark layers) must be 0")
    ratios = [int(r) for r in ratios[:n]]
    if any(r < 0 for r in ratios):
        raise ConfigError(f"config.json: compress_ratios has negative entries {ratios}")
    kv = raw.get("kv_source_layer_ids")
    if kv is None:
        kv = RELEASED_KV_SOURCES if ratios == RELEASED_RATIOS[:n] and n == 40 else [
            i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
    idx = raw.get("index_source_layer_ids")
    if idx is None:
        idx = RELEASED_INDEX_SOURCES if list(kv) == RELEASED_KV_SOURCES else list(kv)
    kv, idx = sorted(int(i) for i in kv), sorted(int(i) for i in idx)
    if any(not 0 <= i < n or ratios[i] == 0 for i in kv + idx):
        raise ConfigError(f"config.json: kv_source_layer_ids {kv} / index_source_layer_ids {idx} must name "
                          f"layers in [0, {n}) with compress_ratios > 0")
    if any(i > 0 and not any(s <= i for s in kv) for i, r in enumerate(ratios) if r):
        raise ConfigError("config.json: every layer with compress_ratios > 0 needs a kv_source_layer_ids entry "
                          "at or before it")
    for i, r in enumerate(ratios):
        if r and ratios[max(s for s in kv if s <= i)] != r:
            raise ConfigError(f"config.json: layer {i} has compress ratio {r} but its KV source has another")
    missing = [s for s in kv if s not in idx]
    if missing:  # the reference would attend a group's KV with the previous group's top-k
        raise ConfigError(f"config.json: KV sources {missing} are not in index_source_layer_ids: not supported")
    cand = raw.get("candidate_source_layer_id")
    cand = (kv[-1] if kv else -1) if cand is None else int(cand)
    if cand >= 0 and cand not in idx:
        raise ConfigError(f"config.json: candidate_source_layer_id {cand} is not an index source {idx}")
    return tuple(ratios), tuple(kv), tuple(idx), cand


def parse_v41_config(full: dict) -> V41Config:
    raw, outer = _text_config(full)
    unknown = sorted(k for k in raw if k not in _READ and k not in _IGNORED)
    if unknown:
        raise ConfigError(f"config.json (text_config): unknown keys {unknown} (not a DeepSeek-V4.1 config?)")
    n = int(raw.get("num_hidden_layers", 40))
    head_dim = int(raw.get("head_dim", 512))
    rope_dim = int(raw.get("qk_rope_head_dim", 64))
    if rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"config.json: qk_rope_head_dim={rope_dim} must be even and <= head_dim={head_dim}")
    heads, groups = int(raw.get("num_attention_heads", 64)), int(raw.get("o_groups", 8))
    if heads % groups:
        raise ConfigError(f"config.json: num_attention_heads={heads} is not divisible by o_groups={groups}")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported")
    if int(raw.get("n_shared_experts", 1)) != 1:
        raise ConfigError("config.json: n_shared_experts must be 1 (V4.1 always has one shared expert)")
    ratios, kv, idx, cand = _schedule(raw, n)
    main_rope, compress_rope = rope(raw, rope_dim)
    qc = raw.get("quantization_config")
    block = (32, 32)
    if qc is not None:
        block = tuple(qc.get("weight_block_size", [32, 32]))
        if block not in ((32, 32), (128, 128)):
            raise ConfigError(f"config.json: quantization_config.weight_block_size={list(block)}: 32x32 or 128x128")
        qc = {k: v for k, v in qc.items() if k not in ("weight_block_size", "expert_dtype")}
    fp8, expert_dtype = quantization({"quantization_config": qc, "expert_dtype": raw.get("expert_dtype")
                                       or (raw.get("quantization_config") or {}).get("expert_dtype")})
    engram_ids = tuple(int(i) for i in raw.get("engram_layer_ids") or ())
    engram_rows = tuple(int(i) for i in raw.get("engram_num_embeddings") or (0,) * len(engram_ids))
    if len(engram_rows) != len(engram_ids) or any(not 0 <= i < n for i in engram_ids):
        raise ConfigError("config.json: engram_num_embeddings must match engram_layer_ids, layers in range")
    eos = raw.get("eos_token_id", 1)
    return V41Config(
        vocab_size=int(raw.get("vocab_size", 129280)), hidden_size=int(raw.get("hidden_size", 5120)), num_layers=n,
        num_heads=heads, head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(raw.get("q_lora_rank", 1280)),
        o_groups=groups, o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2304)),
        n_routed_experts=int(raw.get("n_routed_experts", 384)), num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)), scoring_func=scoring,
        gate_temp=float(raw.get("gate_temp", 1.0)), norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)), sliding_window=int(raw.get("sliding_window", 128)),
        compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=idx, candidate_source_layer_id=cand,
        candidate_topk_blocks=int(raw.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(raw.get("candidate_block_size", 8)),
        index_n_heads=int(raw.get("index_n_heads", 32)), index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)), hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)), hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-20)), main_rope=main_rope, compress_rope=compress_rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1 << 20)),
        bos_token_id=int(raw.get("bos_token_id") or 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        engram_layer_ids=engram_ids, engram_vocab_size=int(raw.get("engram_vocab_size", 16000000)),
        engram_num_embeddings=engram_rows, engram_max_ngram_size=int(raw.get("engram_max_ngram_size", 4)),
        engram_n_heads=int(raw.get("engram_n_heads", 8)), engram_head_dim=int(raw.get("engram_head_dim", 256)),
        engram_pad_id=int(raw.get("engram_pad_id", 2)),
        engram_compressed_vocab_size=int(raw.get("engram_compressed_vocab_size", 99092)),
        image_token_id=outer.get("image_token_id", raw.get("image_token_id")),
        torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
        fp8_linears=fp8, expert_dtype=expert_dtype, weight_block_size=block,
        extra={k: raw[k] for k in raw if k in _IGNORED},
    )


def load_config(model_dir: str | Path) -> V41Config:
    return parse_v41_config(json.loads((Path(model_dir) / "config.json").read_text()))
