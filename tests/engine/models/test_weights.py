"""Checkpoint loading: official names, shards, FP8 block scales, MTP kept, clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.deepseek_v4.config import ConfigError, load_config, parse_config
from engine.models.deepseek_v4.loader import load_model
from engine.models.weights import WeightsError, iter_checkpoint
from kernels.formats import dequantize_fp8_block as dequantize_fp8


def _quantize(w: torch.Tensor, block: int = 128):
    """Per-128x128-block absmax scaling to e4m3, the official layout (weight + .scale)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_dequantisation_matches_reference_loop(tmp_path):
    w = torch.randn(200, 300)  # awkward: partial blocks on both axes
    q, scale = _quantize(w)
    save_file({"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": scale,
               "layers.0.attn.wkv.weight": q.clone(), "layers.0.attn.wkv.weight_scale_inv": scale.clone()},
              str(tmp_path / "model.safetensors"))
    got = dict(iter_checkpoint(tmp_path))
    assert set(got) == {"layers.0.attn.wq_a.weight", "layers.0.attn.wkv.weight"}  # scales consumed
    ref = torch.empty(200, 300)
    for i in range(200):
        for j in range(300):
            ref[i, j] = q[i, j].float() * scale[i // 128, j // 128]
    assert torch.equal(got["layers.0.attn.wq_a.weight"], ref)
    assert torch.equal(got["layers.0.attn.wkv.weight"], ref)
    assert torch.equal(dequantize_fp8(q, scale), ref)
    assert (ref - w).abs().max() <= 0.07 * w.abs().max()  # e4m3 keeps ~2 significant bits of mantissa


def test_sharded_fp8_and_mtp_checkpoint_loads_like_bf16(tiny_dir, tmp_path):
    """Re-shard the tiny checkpoint, store big projections as FP8 and add MTP tensors:
    the loader gives the same network up to FP8 rounding."""
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    fp8 = {}
    for name, t in tensors.items():
        if name.endswith(("wq_b.weight", "wo_a.weight")):
            q, s = _quantize(t.float())
            fp8[name], fp8[name[: -len(".weight")] + ".scale"] = q, s
        else:
            fp8[name] = t
    fp8["mtp.0.emb.weight"] = torch.zeros(4, 4)
    names = sorted(fp8)
    shards = {f"model-0000{i}.safetensors": {n: fp8[n] for n in names[i::2]} for i in range(2)}
    for fname, part in shards.items():
        save_file(part, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in shards.items() for n in part}}))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / f, tmp_path / f)
    a, b = load_model(tiny_dir, torch.float32), load_model(tmp_path, torch.float32)
    assert torch.equal(b.mtp_weights["mtp.0.emb.weight"], torch.zeros(4, 4))  # kept for speculative decoding
    wa = a.layers[0].attn.wq_b.weight
    wb = b.layers[0].attn.wq_b.weight
    assert not torch.equal(wa, wb) and (wa - wb).abs().max() <= 0.07 * wa.abs().max()
    assert torch.equal(a.layers[1].ffn.experts_w1, b.layers[1].ffn.experts_w1)


def test_missing_and_unexpected_tensors_are_named(tiny_dir, tmp_path):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    del tensors["layers.1.attn.indexer.wq_b.weight"]
    tensors["layers.0.attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match=r"layers\.1\.attn\.indexer\.wq_b\.weight.*layers\.0\.attn\.surprise"):
        load_model(tmp_path, torch.float32)


def test_official_and_transformers_configs_read_alike(tiny_dir):
    official = json.loads((tiny_dir / "config.json").read_text())
    a = load_config(tiny_dir)
    assert a.layer_types[1:3] == ("compressed_sparse_attention", "heavily_compressed_attention")
    assert a.compress_ratios == (0, 4, 16, 4) and a.num_hash_layers == 1 and a.rope_dim == 8
    assert a.compress_rope.yarn_factor == 4.0 and a.main_rope.yarn_factor is None
    tf = {k: v for k, v in official.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                           "rope_scaling")}
    tf.update(mlp_layer_types=["hash_moe"] + ["moe"] * 3, partial_rotary_factor=0.25,
              rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 1024}})
    b = parse_config(tf)
    for field in ("layer_types", "compress_ratios", "num_hash_layers", "rope_dim", "main_rope", "compress_rope"):
        assert getattr(a, field) == getattr(b, field), field


@pytest.mark.parametrize("change, message", [
    ({"compres_ratios": [0]}, "unknown keys.*compres_ratios"),
    ({"model_type": "llama"}, "model_type"),
    ({"compress_ratios": [0, 4, 16, 3, 0]}, r"ratios \[3\]"),
    ({"num_attention_heads": 3}, "o_groups"),
    ({"rope_scaling": {"type": "longrope", "factor": 2}}, "longrope"),
    ({"scoring_func": "relu"}, "scoring_func"),
])
def test_bad_configs_name_the_key(tiny_dir, change, message):
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw.pop("layer_types", None)
    raw.pop("compress_rates", None)
    raw.update(change)
    if "compres_ratios" in change:
        raw["compress_ratios"] = [0, 4, 16, 4, 0]
    raw.setdefault("compress_rates", {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
