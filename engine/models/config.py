"""What every DeepSeek-V4-family config shares: the layer kinds, the common fields, RoPE,
the quantization keys. A family's config.py adds its own fields and reads its config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE flavour: plain (sliding layers) or YaRN (compressed layers)."""

    theta: float
    dim: int  # rotated dims (qk_rope_head_dim), the trailing slice of each head
    yarn_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self) -> torch.Tensor:
        """Exactly transformers' float32 computation (default and YaRN with attention_factor 1)."""
        dim, base = self.dim, self.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.yarn_factor is None:
            return 1.0 / pos_freqs

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return (1.0 / (self.yarn_factor * pos_freqs)) * (1 - extrapolation_factor) + (
            1.0 / pos_freqs
        ) * extrapolation_factor


@dataclass(frozen=True, kw_only=True)
class DeepseekConfig:
    """The fields every DeepSeek-V4-family config has; a family's config adds its own."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    sliding_window: int
    compress_ratios: tuple[int, ...]  # per layer, 0 = sliding only
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "bfloat16"
    fp8_linears: bool = False  # quantization_config: dense linears FP8 e4m3 with block scales
    expert_dtype: str = "bf16"  # routed experts as stored: bf16, fp8 (Base) or fp4 (MXFP4)
    extra: dict = field(default_factory=dict, compare=False, repr=False)


def rope(raw: dict, rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    main_theta = float(raw.get("rope_theta", 10000.0))
    comp_theta = float(raw.get("compress_rope_theta", 160000.0))
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("compress"), dict):  # transformers' nested form
        scaling = params["compress"]
        comp_theta = float(scaling.get("rope_theta", comp_theta))
        main_theta = float(params.get("main", {}).get("rope_theta", main_theta))
    elif params and scaling is None:
        scaling = params
    yarn = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "yarn":
            yarn = scaling
        elif kind != "default":
            raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported (yarn or default)")
    main = RopeConfig(theta=main_theta, dim=rope_dim)
    if yarn is None:
        return main, RopeConfig(theta=comp_theta, dim=rope_dim)
    for key in ("factor", "original_max_position_embeddings"):
        if key not in yarn:
            raise ConfigError(f"config.json: rope_scaling (yarn) needs {key!r}")
    comp = RopeConfig(
        theta=comp_theta, dim=rope_dim, yarn_factor=float(yarn["factor"]),
        original_max_position_embeddings=int(yarn["original_max_position_embeddings"]),
        beta_fast=float(yarn.get("beta_fast") or 32), beta_slow=float(yarn.get("beta_slow") or 1),
    )
    return main, comp


def quantization(raw: dict) -> tuple[bool, str]:
    """(FP8 dense linears?, expert dtype) from `quantization_config` and `expert_dtype`
    (top level in V4, inside quantization_config in V4.1)."""
    qc = raw.get("quantization_config")
    expert = raw.get("expert_dtype") or (qc or {}).get("expert_dtype") or ("fp8" if qc else "bf16")
    if expert not in ("bf16", "fp8", "fp4"):
        raise ConfigError(f"config.json: expert_dtype {expert!r} is not bf16, fp8 or fp4")
    if qc is None:
        if expert != "bf16":
            raise ConfigError(f"config.json: expert_dtype {expert!r} needs a quantization_config")
        return False, expert
    want = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    for key, value in want.items():
        if key in qc and qc[key] != value:
            raise ConfigError(f"config.json: quantization_config.{key}={qc[key]!r}, only {value!r} is supported")
    if qc.get("scale_fmt", "ue8m0") not in ("ue8m0", "float"):
        raise ConfigError(f"config.json: quantization_config.scale_fmt={qc['scale_fmt']!r} is not ue8m0 or float")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError("config.json: quantization_config.activation_scheme must be 'dynamic'")
    return True, expert
