"""The 0731 layout (DeepSeek-V4-Flash-0731: three DSpark draft stages under mtp.*, docs/DSPARK.md):
the config keys, the writer's tensors and formats, the loader's check of the section naming the
tensor, plain decoding on a 0731 checkpoint, and the preview layout's MTP refused on it."""

import json
import shutil
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models.deepseek_v4.config import ConfigError, parse_config
from engine.models.deepseek_v4.dspark import DSparkDrafter, _checkpoint_name, module_name
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import PRESETS, QUANTS, build_config, write_checkpoint
from engine.models.weights import WeightsError
from tests.engine.conftest import incremental_logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    return {q: write_checkpoint(root / q, "tiny", seed=7, quant=q, layout="0731") for q in ("bf16", "fp8-fp4")}


def test_flash_depth_0731_config_is_the_shipped_one():
    raw = build_config("flash-depth", quant="fp8-fp4", layout="0731")
    assert raw["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]  # 46 for 43 layers
    cfg = parse_config(raw)
    d = cfg.dspark
    assert (d.block_size, d.noise_token_id, d.markov_rank, d.target_layer_ids, d.num_stages) == \
        (5, 128799, 256, (40, 41, 42), 3)
    assert cfg.num_layers == 43 and cfg.compress_ratios == tuple(raw["compress_ratios"][:43])
    assert parse_config(build_config("flash-depth")).dspark is None  # the preview layout


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("quant", QUANTS)
def test_every_preset_has_a_0731_layout(preset, quant):
    raw = build_config(preset, quant=quant, layout="0731")
    cfg = parse_config(raw)
    n = cfg.num_layers
    assert cfg.dspark.target_layer_ids == tuple(range(n - 3, n)) and len(raw["compress_ratios"]) == n + 3
    assert raw["compress_ratios"][n:] == [0, 0, 0] and cfg.dspark.noise_token_id < cfg.vocab_size


def test_stage_tensor_counts_match_the_shipped_index():
    """DeepSeek-V4-Flash-0731's weight index holds 1568 / 1565 / 1572 tensors under mtp.0 / 1 / 2
    (256 FP4 experts with scales, FP8 linears with scales)."""
    cfg = parse_config(build_config("flash-depth", quant="fp8-fp4", layout="0731", override={"n_routed_experts": 256}))
    with torch.device("meta"):
        names = DSparkDrafter(cfg, quantized=True).expected_names()
    per_stage = Counter(_checkpoint_name(n, 3).split(".")[1] for n in names)
    assert per_stage == {"0": 1568, "1": 1565, "2": 1572}


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("dspark_markov_rank"), "without \\['dspark_markov_rank'\\]"),
    (lambda r: r.update(dspark_target_layer_ids=[2, 4]), "dspark_target_layer_ids \\[2, 4\\]"),
    (lambda r: r.update(dspark_target_layer_ids=[3, 3]), "must be distinct"),
    (lambda r: r.update(dspark_noise_token_id=4096), "dspark_noise_token_id=4096 is outside"),
    (lambda r: r.update(compress_ratios=r["compress_ratios"][:5]), "compress_ratios has 5 entries"),
    (lambda r: r.update(num_nextn_predict_layers=0), "num_nextn_predict_layers >= 1"),
    (lambda r: r.update(dspark_block_size=0), "dspark_block_size=0"),
])
def test_malformed_dspark_config_is_refused_naming_the_key(change, message):
    raw = build_config("tiny", layout="0731")
    change(raw)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_writer_stores_the_stages_in_their_shipped_formats(ckpt):
    with safe_open(str(ckpt["fp8-fp4"] / "model.safetensors"), "pt") as f:
        dt = {n: f.get_slice(n).get_dtype() for n in f.keys()}
        shape = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert dt["mtp.0.main_proj.weight"] == "F8_E4M3" and dt["mtp.0.main_proj.scale"] == "F8_E8M0"
    assert shape["mtp.0.main_proj.weight"] == [64, 3 * 64]  # three target layers, hidden 64
    assert dt["mtp.1.attn.wq_b.weight"] == "F8_E4M3" and dt["mtp.2.ffn.experts.3.w1.weight"] == "I8"
    assert dt["mtp.2.markov_head.markov_w1.weight"] == dt["mtp.2.markov_head.markov_w2.weight"] == "BF16"
    assert shape["mtp.2.markov_head.markov_w2.weight"] == [4096, 16]
    assert dt["mtp.2.confidence_head.proj.weight"] == "F32" and shape["mtp.2.confidence_head.proj.weight"] == [1, 80]
    assert dt["mtp.2.hc_head_fn"] == "F32" and "mtp.2.ffn.gate.bias" in dt  # routed, never hash, stages
    assert not any(n.startswith("mtp.3.") or ("compressor" in n and n.startswith("mtp.")) for n in dt)
    assert not any(n.startswith("mtp.") and ("e_proj" in n or "enorm" in n) for n in dt)  # no NextN layer


@pytest.mark.parametrize("quant", ["bf16", "fp8-fp4"])
def test_0731_checkpoint_serves_plain_decoding(ckpt, tmp_path, quant):
    """The main weights of a 0731 checkpoint are those of the preview one with the same seed (tensors
    are seeded by name): the same logits, the draft stages kept aside (as stored when quantized)."""
    preview = write_checkpoint(tmp_path / "preview", "tiny", seed=7, quant=quant)
    model = load_model(ckpt[quant], torch.float32, quantized=quant != "bf16")
    ids = list(range(7, 40))
    want = incremental_logits(load_model(preview, torch.float32, quantized=quant != "bf16"), ids, chunks=[20])
    assert torch.equal(incremental_logits(model, ids, chunks=[20]), want)
    assert {module_name(n, 3) is not None for n in model.mtp_weights} == {True}
    if quant != "bf16":
        assert model.mtp_weights["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
        assert model.mtp_weights["mtp.1.ffn.experts.0.w2.weight"].dtype == torch.int8


def test_mtp_is_refused_on_a_0731_checkpoint(ckpt):
    model = load_model(ckpt["bf16"], torch.float32)
    with pytest.raises(WeightsError, match="ships 3 DSpark draft stages"):
        model.mtp_draft()


def _rewrite(src, dst, change):
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)


def _move(t, src, dst):
    t[dst] = t.pop(src)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("mtp.2.markov_head.markov_w1.weight"), "missing \\['mtp.2.markov_head.markov_w1.weight'\\]"),
    (lambda t: t.pop("mtp.1.ffn.experts.5.w3.weight"), "missing \\['mtp.1.ffn.experts.5.w3.weight'\\]"),
    (lambda t: _move(t, "mtp.2.confidence_head.proj.weight", "mtp.1.confidence_head.proj.weight"),
     "unexpected \\['mtp.1.confidence_head.proj.weight'\\]"),
    (lambda t: t.__setitem__("mtp.3.attn_norm.weight", torch.ones(64)), "unexpected \\['mtp.3.attn_norm.weight'\\]"),
    (lambda t: t.__setitem__("mtp.2.markov_head.markov_w2.weight", torch.zeros(4096, 8)),
     "mtp.2.markov_head.markov_w2.weight: checkpoint shape \\(4096, 8\\)"),
    (lambda t: t.__setitem__("mtp.0.main_proj.weight", torch.zeros(64, 128)),
     "mtp.0.main_proj.weight: checkpoint shape \\(64, 128\\)"),
])
def test_malformed_dspark_section_is_refused_naming_the_tensor(ckpt, tmp_path, change, message):
    _rewrite(ckpt["bf16"], tmp_path, change)
    with pytest.raises(WeightsError, match=message):
        load_model(tmp_path, torch.float32)


def test_cli_writes_the_0731_layout(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "tools.make_tiny_checkpoint", str(tmp_path), "--layout", "0731"],
                   check=True, capture_output=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dspark_block_size"] == 5 and len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 3
