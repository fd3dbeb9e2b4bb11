"""The checkpoint writer: official layout, deterministic, loadable by transformers."""

import json

import pytest
import torch
from safetensors import safe_open

from engine.models.deepseek_v4.random_checkpoint import build_config, write_checkpoint

OFFICIAL = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
            "layers.0.attn.wq_a.weight", "layers.0.attn.kv_norm.weight", "layers.0.attn.attn_sink",
            "layers.0.hc_attn_fn", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
            "layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.shared_experts.w2.weight",
            "layers.1.attn.compressor.ape", "layers.1.attn.indexer.wq_b.weight",
            "layers.1.attn.indexer.compressor.norm.weight", "layers.2.attn.compressor.wgate.weight"]


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_official_names_keys_and_dtypes(tmp_path):
    write_checkpoint(tmp_path, "tiny", seed=3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 16, 4, 0]  # one per layer plus the MTP slot
    for key in ("num_hash_layers", "qk_rope_head_dim", "sliding_window", "index_topk", "rope_scaling"):
        assert key in cfg
    t = _tensors(tmp_path)
    assert set(OFFICIAL) <= set(t)
    assert not any(".self_attn." in k or "attn.norm.weight" in k for k in t)  # not transformers' names
    assert t["layers.1.attn.compressor.ape"].dtype == torch.float32
    assert t["layers.0.hc_attn_fn"].dtype == torch.float32
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    tid = t["layers.0.ffn.gate.tid2eid"]
    assert not tid.is_floating_point() and tid.shape == (cfg["vocab_size"], cfg["num_experts_per_tok"])
    assert all(len(set(row.tolist())) == row.numel() for row in tid[:64])  # distinct experts per token
    # the indexer really selects: top-k below the entries of a few hundred tokens
    assert cfg["index_topk"] < 256 // 4
    assert (tmp_path / "tokenizer.json").exists() and "chat_template" in json.loads(
        (tmp_path / "tokenizer_config.json").read_text())


def test_same_seed_same_tensors_other_seed_differs(tmp_path):
    a, b, c = (write_checkpoint(tmp_path / n, "tiny", seed=s) for n, s in (("a", 1), ("b", 1), ("c", 2)))
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["layers.0.attn.wq_a.weight"], tc["layers.0.attn.wq_a.weight"])


def test_override_merges_and_adds_mtp_slot():
    cfg = build_config("tiny", {"num_hidden_layers": 3, "compress_ratios": [4, 0, 32], "sliding_window": 8})
    assert cfg["compress_ratios"] == [4, 0, 32, 0] and cfg["sliding_window"] == 8
    assert cfg["layer_types"][2] == "heavily_compressed_attention"
    with pytest.raises(ValueError, match="compress_ratios"):
        build_config("tiny", {"compress_ratios": [0, 4]})


def _transformers_logits(path):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not any(info.values()), info  # every official name mapped, nothing missing
    model = model.float().eval()
    with torch.no_grad():
        return model(torch.arange(2, 40)[None] % model.config.vocab_size).logits


def test_tiny_loads_in_transformers(tmp_path):
    logits = _transformers_logits(write_checkpoint(tmp_path, "tiny"))
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # not flat


@pytest.mark.slow
def test_flash_shaped_loads_in_transformers(tmp_path):
    # V4-Flash per-layer dimensions, fewer layers/experts and a small vocab to fit CI
    out = write_checkpoint(tmp_path, "flash-shaped", override={
        "num_hidden_layers": 2, "compress_ratios": [4, 128], "n_routed_experts": 2, "num_experts_per_tok": 2,
        "num_hash_layers": 1, "vocab_size": 4096})
    assert (out / "model.safetensors.index.json").exists()  # big presets are sharded per layer
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["index_topk"]) == (4096, 64, 512, 512)
    assert torch.isfinite(_transformers_logits(out)).all()


def test_shards_spill_to_another_dir_when_the_disk_would_fill(tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.models.deepseek_v4.random_checkpoint import _shard_path

    out, spill = tmp_path / "out", tmp_path / "spill"
    out.mkdir()
    assert _shard_path(out, "a.safetensors", 1, spill) == out / "a.safetensors"
    assert _shard_path(out, "b.safetensors", 1 << 62, None) == out / "b.safetensors"  # no spill dir: the disk's error
    path = _shard_path(out, "b.safetensors", 1 << 62, spill)  # more than any disk holds
    assert path == spill / "b.safetensors" and (out / "b.safetensors").is_symlink()
    save_file({"x": torch.arange(3.0)}, str(path))
    assert load_file(str(out / "b.safetensors"))["x"].tolist() == [0.0, 1.0, 2.0]
