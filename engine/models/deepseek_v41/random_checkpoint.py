"""Seeded random DeepSeek-V4.1 checkpoints in the official layout (CLI: tools/make_tiny_checkpoint.py --v41).

Official tensor names (`layers.N.attn.compressor.wkv.weight`, `layers.N.attn.indexer.wk.weight`,
`layers.N.ffn.experts.E.w1.weight`, `layers.N.engram.embed.weight`, ...) and the released composite
config.json (`text_config` nested). `quant="fp8-fp4"` stores what V4.1 ships: attention projections,
shared experts and `engram.wkv` as FP8 e4m3 with one ue8m0 scale per 32x32 tile, routed experts as
packed FP4 e2m1 with ue8m0 scales per 32 values, Engram tables as FP8 rows with a scale per 32
channels; compressor / indexer projections, embed and head bf16; mHC, sinks, gate biases fp32.

Presets: `v41-tiny` (every layer kind, seconds on a CPU) and `v41-flash-shaped` (the released
per-layer dimensions and the released 40-layer schedule; 8 routed experts and Engram tables of
~2.4M rows instead of 384 experts and 384M rows, so it fits one H200).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.deepseek_v4.random_checkpoint import _Rand, expert_tensors, write_tokenizer
from engine.models.deepseek_v41.config import RELEASED_INDEX_SOURCES, RELEASED_KV_SOURCES, RELEASED_RATIOS
from engine.models.deepseek_v41.engram import EngramLayout, compressed_token_map
from engine.models.deepseek_v41.weights import quantize_rows
from kernels.formats import quantize_fp8_block, quantize_mxfp4

COMMON = dict(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20, routed_scaling_factor=1.5,
              scoring_func="sqrtsoftplus", topk_method="noaux_tc", swiglu_limit=10.0, bos_token_id=0, eos_token_id=1,
              rope_theta=10000.0, compress_rope_theta=160000.0, engram_max_ngram_size=4, engram_pad_id=2,
              num_nextn_predict_layers=0, n_shared_experts=1, gate_temp=1.0, norm_topk_prob=True)
PRESETS: dict[str, dict] = {
    "v41-tiny": dict(
        vocab_size=4004, hidden_size=64, num_hidden_layers=10, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8], candidate_source_layer_id=6,
        candidate_topk_blocks=6, candidate_block_size=4, index_n_heads=8, index_head_dim=32, index_topk=8,
        engram_layer_ids=[1, 4], engram_vocab_size=64, engram_n_heads=2, engram_head_dim=32,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32.0, "beta_slow": 1.0}),
    "v41-flash-shaped": dict(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2304,
        n_routed_experts=8, num_experts_per_tok=6, sliding_window=128, compress_ratios=RELEASED_RATIOS,
        kv_source_layer_ids=RELEASED_KV_SOURCES, index_source_layer_ids=RELEASED_INDEX_SOURCES,
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8, index_n_heads=32,
        index_head_dim=128, index_topk=512, engram_layer_ids=[1, 14], engram_vocab_size=100_000, engram_n_heads=8,
        engram_head_dim=256, max_position_embeddings=1048576,
        rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": 32.0, "beta_slow": 1.0}),
}
QUANTS = ("bf16", "fp8-fp4")
FP8_TILE = 32
FP8_LINEAR = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.shared_experts\.w[123]\.weight$|"
                        r"\.engram\.wkv\.weight$")
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def build_text_config(preset: str, tokenizer_json: Path, override: dict | None = None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = {**COMMON, **PRESETS[preset], **(override or {})}
    _, compressed = compressed_token_map(tokenizer_json)
    layout = EngramLayout.build(len(cfg["engram_layer_ids"]), cfg["engram_max_ngram_size"], cfg["engram_n_heads"],
                                cfg["engram_vocab_size"])
    cfg["engram_compressed_vocab_size"] = compressed
    cfg["engram_num_embeddings"] = layout.table_rows()
    cfg["model_type"] = "deepseek_v41_text"
    return cfg


def layer_tensors(cfg: dict, i: int, r: _Rand) -> dict[str, torch.Tensor]:
    D, H, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q_lora, groups, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    hc, inter, E = cfg["hc_mult"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    ratio, p, f32 = cfg["compress_ratios"][i], f"layers.{i}.", torch.float32
    mix = (2 + hc) * hc
    t = {
        p + "attn_norm.weight": r.norm(p + "attn_norm", D), p + "ffn_norm.weight": r.norm(p + "ffn_norm", D),
        p + "attn.wq_a.weight": r.linear(p + "wq_a", q_lora, D), p + "attn.q_norm.weight": r.norm(p + "q_norm", q_lora),
        p + "attn.wq_b.weight": r.linear(p + "wq_b", H * hd, q_lora), p + "attn.wkv.weight": r.linear(p + "wkv", hd, D),
        p + "attn.kv_norm.weight": r.norm(p + "kv_norm", hd),
        p + "attn.wo_a.weight": r.linear(p + "wo_a", groups * o_lora, H * hd // groups),
        p + "attn.wo_b.weight": r.linear(p + "wo_b", D, groups * o_lora),
        p + "attn.attn_sink": r.normal(p + "attn_sink", (H,), 1.0, dtype=f32),
        p + "ffn.gate.weight": r.linear(p + "gate", E, D),
        p + "ffn.gate.bias": r.normal(p + "gate.bias", (E,), 0.1, dtype=f32),
        p + "ffn.gate.bias_vl": r.normal(p + "gate.bias_vl", (E,), 0.1, dtype=f32),
    }
    for kind in ("attn", "ffn"):  # small mixing weights keep the hc streams stable
        t[p + f"hc_{kind}_fn"] = r.normal(p + f"hc_{kind}_fn", (mix, hc * D), 0.02, dtype=f32)
        t[p + f"hc_{kind}_base"] = r.normal(p + f"hc_{kind}_base", (mix,), 0.1, dtype=f32)
        t[p + f"hc_{kind}_scale"] = r.normal(p + f"hc_{kind}_scale", (3,), 0.1, mean=0.5, dtype=f32)
    if i in cfg["kv_source_layer_ids"]:
        c = p + "attn.compressor."
        t[c + "wkv.weight"] = r.linear(c + "wkv", hd, D)
        if ratio > 1:
            t[c + "wgate.weight"] = r.linear(c + "wgate", hd, D)
        t[c + "norm.weight"] = r.norm(c + "norm", hd)
    if i in cfg["index_source_layer_ids"]:
        ih, ihd, x = cfg["index_n_heads"], cfg["index_head_dim"], p + "attn.indexer."
        t[x + "wq_b.weight"] = r.linear(x + "wq_b", ih * ihd, q_lora)
        t[x + "weights_proj.weight"] = r.linear(x + "weights_proj", ih, D)
        if i in cfg["kv_source_layer_ids"]:
            t[x + "wk.weight"] = r.linear(x + "wk", ihd, hd)
            t[x + "k_norm.weight"] = r.norm(x + "k_norm", ihd)
    if i in cfg["engram_layer_ids"]:
        k, x = cfg["engram_layer_ids"].index(i), p + "engram."
        cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
        t[x + "embed.weight"] = r.normal(x + "embed", (cfg["engram_num_embeddings"][k], cfg["engram_head_dim"]), 1.0)
        t[x + "wkv.weight"] = r.linear(x + "wkv", D * (hc + 1), cols * cfg["engram_head_dim"])
        t[x + "q_weight"] = r.normal(x + "q_weight", (hc, D), 0.2, mean=1.0)
        t[x + "k_weight"] = r.normal(x + "k_weight", (hc, D), 0.2, mean=1.0)
    t.update(expert_tensors(r, p, E, inter, D))
    s = p + "ffn.shared_experts."
    t[s + "w1.weight"], t[s + "w3.weight"] = r.linear(s + "w1", inter, D), r.linear(s + "w3", inter, D)
    t[s + "w2.weight"] = r.linear(s + "w2", D, inter)
    return t


def quantize_tensors(tensors: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    if quant == "bf16":
        return tensors
    out = {}
    for name, t in tensors.items():
        stem = name[: -len(".weight")]
        if ROUTED_EXPERT.search(name):
            out[name], out[stem + ".scale"] = quantize_mxfp4(t)
        elif FP8_LINEAR.search(name):
            out[name], out[stem + ".scale"] = quantize_fp8_block(t, block=FP8_TILE)
        elif name.endswith(".engram.embed.weight"):
            out[name], out[stem + ".scale"] = quantize_rows(t, 32)
        else:
            out[name] = t
    return out


def write_v41_checkpoint(out: str | Path, preset: str = "v41-tiny", seed: int = 0, override: dict | None = None,
                         device: str = "cpu", quant: str = "bf16") -> Path:
    """config.json (composite, as released), the repository's tokenizer, one shard per layer."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose from {QUANTS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    text = build_text_config(preset, out / "tokenizer.json", override)
    full = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
            "text_config": text, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if quant == "fp8-fp4":
        full["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "weight_block_size": [FP8_TILE, FP8_TILE], "activation_scheme": "dynamic",
                                       "expert_dtype": "fp4"}
    r = _Rand(seed, device)
    weight_map = {}
    D, V = text["hidden_size"], text["vocab_size"]
    parts = [{"embed.weight": r.normal("embed", (V, D), 1.0), "head.weight": r.linear("head", V, D),
              "norm.weight": r.norm("norm", D)}]
    for i in range(-1, text["num_hidden_layers"]):
        tensors = parts[0] if i < 0 else layer_tensors(text, i, r)
        tensors = {n: t.cpu().contiguous() for n, t in quantize_tensors(tensors, quant).items()}
        shard = f"model-{i + 1:05d}.safetensors"
        save_file(tensors, str(out / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(full, indent=2))
    return out
