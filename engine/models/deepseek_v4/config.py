"""DeepSeek-V4 model configuration: official config.json or transformers-style, one dataclass.

Official checkpoints carry `compress_ratios` (one per layer plus the MTP slot),
`num_hash_layers`, `qk_rope_head_dim` and `rope_scaling`; transformers' own configs carry
`layer_types`, `mlp_layer_types`, `compress_rates` and `rope_parameters`. Both read into
`ModelConfig`; anything unknown or inconsistent fails here, naming the key.

The 0731 release (DeepSeek-V4-Flash-0731, -DSpark) adds `dspark_*` keys for its three DSpark
draft stages stored under `mtp.0/1/2` (docs/DSPARK.md); they read into `DSparkConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import (
    CSA,
    HCA,
    SLIDING,
    ConfigError,
    DeepseekConfig,
    quantization,
    rope,
)


@dataclass(frozen=True)
class DSparkConfig:
    """The 0731 draft stages (docs/DSPARK.md): `num_stages` blocks under `mtp.0..`, fed the target's
    residual streams at `target_layer_ids`, drafting `block_size` tokens per step."""

    block_size: int
    noise_token_id: int  # fills the block's positions after its first (real) token
    markov_rank: int
    target_layer_ids: tuple[int, ...]
    num_stages: int
    n_routed_experts: int  # the stages' MoE (the main model's unless dspark_n_routed_experts says)
    num_experts_per_tok: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig(DeepseekConfig):
    """DeepSeek-V4: a shared expert count, the layer kinds and the hash-routed layers on top of the common fields."""

    n_shared_experts: int
    layer_types: tuple[str, ...]
    num_hash_layers: int
    dspark: DSparkConfig | None = None  # the 0731 layout's draft stages; None: the preview's one NextN layer

    @property
    def is_hash_layer(self) -> tuple[bool, ...]:
        return tuple(i < self.num_hash_layers for i in range(self.num_layers))

    @property
    def compress_block_lcm(self) -> int:
        """Every prefix-cache block boundary must close a block of every compressor."""
        out = 1
        for r in self.compress_ratios:
            if r:
                out = math.lcm(out, r)
        return out


_DSPARK_KEYS = ("block_size", "noise_token_id", "markov_rank", "target_layer_ids")  # all or none

# Keys we read or knowingly ignore; anything else is a typo or a model we do not serve.
_IGNORED = {
    "architectures", "model_type", "transformers_version", "num_key_value_heads", "norm_topk_prob",
    "topk_method", "tie_word_embeddings", "num_nextn_predict_layers", "initializer_range", "hidden_act",
    "use_cache", "pad_token_id", "attention_bias", "attention_dropout", "mlp_bias", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "dtype",
    "torch_dtype", "partial_rotary_factor", "n_group", "topk_group", "first_k_dense_replace",
    "auto_map", "_name_or_path", "kv_lora_rank", "generation_config", "scale_fmt",
}
_READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor", "scoring_func", "swiglu_limit",
    "sliding_window", "compress_ratios", "layer_types", "compress_rates", "num_hash_layers",
    "mlp_layer_types", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "quantization_config", "expert_dtype",
    *(f"dspark_{k}" for k in _DSPARK_KEYS), "dspark_n_routed_experts", "dspark_num_experts_per_tok",
}


def _need(raw: dict, key: str):
    if key not in raw:
        raise ConfigError(f"config.json: missing required key {key!r}")
    return raw[key]


def _layer_types(raw: dict, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    rates = raw.get("compress_rates") or {CSA: 4, HCA: 128}
    if "layer_types" in raw and raw["layer_types"] is not None:
        types = tuple(raw["layer_types"][:n])
        ratio_of = {SLIDING: 0, **rates}
        bad = [t for t in types if t not in ratio_of]
        if bad:
            raise ConfigError(f"config.json: layer_types has unknown entries {bad}")
        ratios = tuple(ratio_of[t] for t in types)
        if "compress_ratios" in raw and tuple(raw["compress_ratios"][:n]) != ratios:
            raise ConfigError(
                f"config.json: compress_ratios {raw['compress_ratios'][:n]} disagrees with layer_types {list(types)}"
            )
    elif "compress_ratios" in raw:
        ratios = tuple(int(r) for r in raw["compress_ratios"][:n])
        type_of = {0: SLIDING, rates.get(CSA, 4): CSA, rates.get(HCA, 128): HCA}
        bad = [r for r in ratios if r not in type_of]
        if bad:
            raise ConfigError(f"config.json: compress_ratios has ratios {bad} outside {sorted(type_of)}")
        types = tuple(type_of[r] for r in ratios)
    else:
        raise ConfigError("config.json: needs compress_ratios (official) or layer_types (transformers)")
    if len(types) != n:
        raise ConfigError(f"config.json: {len(types)} layer types for num_hidden_layers={n}")
    return types, ratios


def _dspark(raw: dict, n: int) -> DSparkConfig | None:
    """The 0731 keys, checked against the model; the stage count is num_nextn_predict_layers,
    each stage with its compress_ratios slot after the layers' (46 entries for 43 layers)."""
    present = [k for k in raw if k.startswith("dspark_")]
    if not present:
        return None
    missing = [f"dspark_{k}" for k in _DSPARK_KEYS if f"dspark_{k}" not in raw]
    if missing:
        raise ConfigError(f"config.json: DSpark keys {sorted(present)} without {missing}")
    vocab = int(_need(raw, "vocab_size"))
    stages = int(raw.get("num_nextn_predict_layers", 0))
    targets = tuple(int(i) for i in raw["dspark_target_layer_ids"])
    out = DSparkConfig(
        block_size=int(raw["dspark_block_size"]), noise_token_id=int(raw["dspark_noise_token_id"]),
        markov_rank=int(raw["dspark_markov_rank"]), target_layer_ids=targets, num_stages=stages,
        n_routed_experts=int(raw.get("dspark_n_routed_experts", raw["n_routed_experts"])),
        num_experts_per_tok=int(raw.get("dspark_num_experts_per_tok", raw["num_experts_per_tok"])),
    )
    if stages < 1:
        raise ConfigError(f"config.json: DSpark needs num_nextn_predict_layers >= 1 draft stages, got {stages}")
    if len(raw.get("compress_ratios") or []) not in (0, n + stages):
        raise ConfigError(f"config.json: compress_ratios has {len(raw['compress_ratios'])} entries; the DSpark "
                          f"layout has one per layer and per draft stage ({n} + {stages})")
    if out.block_size < 1 or out.markov_rank < 1:
        raise ConfigError(f"config.json: dspark_block_size={out.block_size} and dspark_markov_rank="
                          f"{out.markov_rank} must be >= 1")
    if not 0 <= out.noise_token_id < vocab:
        raise ConfigError(f"config.json: dspark_noise_token_id={out.noise_token_id} is outside the vocabulary ({vocab})")
    if not targets or len(set(targets)) != len(targets) or not all(0 <= i < n for i in targets):
        raise ConfigError(f"config.json: dspark_target_layer_ids {list(targets)} must be distinct layers in [0, {n})")
    if not 1 <= out.num_experts_per_tok <= out.n_routed_experts:
        raise ConfigError(f"config.json: DSpark stages route {out.num_experts_per_tok} of {out.n_routed_experts} experts")
    return out


def parse_config(raw: dict) -> ModelConfig:
    unknown = sorted(k for k in raw if k not in _READ and k not in _IGNORED)
    if unknown:
        raise ConfigError(f"config.json: unknown keys {unknown} (not a DeepSeek-V4 config?)")
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"config.json: model_type {raw['model_type']!r} is not deepseek_v4")
    n = int(_need(raw, "num_hidden_layers"))
    head_dim = int(_need(raw, "head_dim"))
    if "qk_rope_head_dim" in raw:
        rope_dim = int(raw["qk_rope_head_dim"])
    elif raw.get("partial_rotary_factor"):
        rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
    else:
        rope_dim = 64
    types, ratios = _layer_types(raw, n)
    if "mlp_layer_types" in raw and raw["mlp_layer_types"] is not None:
        mlp = list(raw["mlp_layer_types"][:n])
        num_hash = sum(1 for t in mlp if t == "hash_moe")
        if mlp != ["hash_moe"] * num_hash + ["moe"] * (n - num_hash):
            raise ConfigError(f"config.json: mlp_layer_types must be hash_moe* then moe*, got {mlp}")
    else:
        num_hash = min(n, int(raw.get("num_hash_layers", 3)))
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported")
    heads = int(_need(raw, "num_attention_heads"))
    groups = int(raw.get("o_groups", 8))
    if heads % groups:
        raise ConfigError(f"config.json: num_attention_heads={heads} is not divisible by o_groups={groups}")
    if rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"config.json: qk_rope_head_dim={rope_dim} must be even and <= head_dim={head_dim}")
    main_rope, compress_rope = rope(raw, rope_dim)
    fp8_linears, expert_dtype = quantization(raw)
    eos = raw.get("eos_token_id", 1)
    return ModelConfig(
        vocab_size=int(_need(raw, "vocab_size")),
        hidden_size=int(_need(raw, "hidden_size")),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(_need(raw, "q_lora_rank")),
        o_groups=groups,
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        moe_intermediate_size=int(_need(raw, "moe_intermediate_size")),
        n_routed_experts=int(_need(raw, "n_routed_experts")),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_need(raw, "num_experts_per_tok")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        scoring_func=scoring,
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        sliding_window=int(raw.get("sliding_window", 128)),
        compress_ratios=ratios,
        layer_types=types,
        num_hash_layers=num_hash,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1 << 20)),
        bos_token_id=int(raw.get("bos_token_id", 0)),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
        fp8_linears=fp8_linears,
        expert_dtype=expert_dtype,
        dspark=_dspark(raw, n),
        extra={k: raw[k] for k in raw if k in _IGNORED},
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    return parse_config(json.loads(path.read_text()))
