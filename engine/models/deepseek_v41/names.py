"""transformers' DeepseekV41 tensor names -> DeepSeek's official ones (the engine's).

From transformers' `deepseek_v41_text` conversion rules (and the oracle's NAMES.md): a checkpoint
saved by transformers holds its module names; routed experts are fused there
(`gate_up_proj[e] = cat(w1_e, w3_e)`, `down_proj[e] = w2_e`) and split back here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight"}
_LAYER = [  # (transformers suffix after model.layers.L., official suffix after layers.L.)
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    *((f"attn_hc.{k}", f"hc_attn_{k}") for k in ("fn", "base", "scale")),
    *((f"ffn_hc.{k}", f"hc_ffn_{k}") for k in ("fn", "base", "scale")),
    *((f"self_attn.{a}.weight", f"attn.{b}.weight") for a, b in (
        ("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
        ("kv_norm", "kv_norm"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"),
        ("compressor.kv_proj", "compressor.wkv"), ("compressor.gate_proj", "compressor.wgate"),
        ("compressor.kv_norm", "compressor.norm"), ("indexer.q_b_proj", "indexer.wq_b"),
        ("indexer.k_proj", "indexer.wk"), ("indexer.k_norm", "indexer.k_norm"),
        ("indexer.weights_proj", "indexer.weights_proj"))),
    ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.e_score_correction_bias_vl", "ffn.gate.bias_vl"),
    *((f"mlp.shared_experts.{a}.weight", f"ffn.shared_experts.{b}.weight")
      for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))),
    *((f"engram.{k}", f"engram.{k}") for k in ("wkv.weight", "q_weight", "k_weight")),
]
_LAYER_MAP = dict(_LAYER)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TABLE_RE = re.compile(r"model\.engram_tables\.(\d+)\.(weight|weight_scale_inv)")


def is_transformers_name(name: str) -> bool:
    return name.startswith("model.") or name == "lm_head.weight"


def to_official(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Official (name, tensor) pairs for one transformers tensor; names already official pass."""
    if not is_transformers_name(name):
        yield name, tensor
        return
    if name in _GLOBAL:
        yield _GLOBAL[name], tensor
        return
    if m := _TABLE_RE.fullmatch(name):
        yield f"layers.{m[1]}.engram.embed.{'weight' if m[2] == 'weight' else 'scale'}", tensor
        return
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        raise KeyError(name)
    layer, rest = m[1], m[2]
    if rest == "mlp.experts.gate_up_proj":
        inter = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"layers.{layer}.ffn.experts.{e}.w1.weight", tensor[e, :inter]
            yield f"layers.{layer}.ffn.experts.{e}.w3.weight", tensor[e, inter:]
        return
    if rest == "mlp.experts.down_proj":
        for e in range(tensor.shape[0]):
            yield f"layers.{layer}.ffn.experts.{e}.w2.weight", tensor[e]
        return
    if rest.endswith(".scale") and rest[: -len("scale")] + "weight" in _LAYER_MAP:  # a kept FP8 linear's scale
        yield f"layers.{layer}.{_LAYER_MAP[rest[: -len('scale')] + 'weight'][: -len('weight')]}scale", tensor
        return
    if rest not in _LAYER_MAP:
        raise KeyError(name)
    yield f"layers.{layer}.{_LAYER_MAP[rest]}", tensor


def official_name(name: str) -> str | None:
    """The official name of a one-tensor entry (every name but transformers' fused experts: None)."""
    if not is_transformers_name(name):
        return name
    if name in _GLOBAL:
        return _GLOBAL[name]
    if (m := _TABLE_RE.fullmatch(name)) and m[2] == "weight":
        return f"layers.{m[1]}.engram.embed.weight"
    m = _LAYER_RE.fullmatch(name)
    return f"layers.{m[1]}.{_LAYER_MAP[m[2]]}" if m is not None and m[2] in _LAYER_MAP else None


def to_transformers(name: str) -> str:
    """The inverse for non-expert tensors (tests write transformers-named checkpoints with it)."""
    if name in (inv := {v: k for k, v in _GLOBAL.items()}):
        return inv[name]
    m = re.fullmatch(r"layers\.(\d+)\.engram\.embed\.weight", name)
    if m:
        return f"model.engram_tables.{m[1]}.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    back = {v: k for k, v in _LAYER}
    if m is None or m[2] not in back:
        raise KeyError(name)
    return f"model.layers.{m[1]}.{back[m[2]]}"
