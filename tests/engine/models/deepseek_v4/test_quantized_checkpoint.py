"""Quantized checkpoints as shipped: the writer's formats and names, loading that keeps them (or
dequantizes once on the CPU), MTP tensors kept, malformed scales refused naming the tensor."""

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models.deepseek_v4.config import ConfigError, parse_config
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import PRESETS, QUANTS, build_config, write_checkpoint
from engine.models.weights import WeightsError, iter_checkpoint
from tests.engine.conftest import KERNELS_TINY, incremental_logits


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny preset cut for the interpreter (KERNELS_TINY: the fused-kernel test below), window 8."""
    root = tmp_path_factory.mktemp("quant")
    return {q: write_checkpoint(root / q, "tiny", seed=7, quant=q, override={**KERNELS_TINY, "sliding_window": 8})
            for q in ("fp8", "fp8-fp4")}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("quant", QUANTS)
def test_every_preset_gets_the_official_config_keys(preset, quant):
    cfg = parse_config(build_config(preset, quant=quant))
    assert cfg.expert_dtype == {"bf16": "bf16", "fp8": "fp8", "fp8-fp4": "fp4"}[quant]
    assert cfg.fp8_linears == (quant != "bf16")
    raw = build_config(preset, quant=quant)
    if quant == "fp8-fp4":
        assert raw["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                              "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def test_writer_stores_the_shipped_formats_under_official_names(quantized):
    with safe_open(str(quantized["fp8-fp4"] / "model.safetensors"), "pt") as f:
        dt = {n: f.get_slice(n).get_dtype() for n in f.keys()}
        shape = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert dt["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dt["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dt["layers.1.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dt["layers.1.ffn.experts.5.w1.weight"] == "I8" and shape["layers.1.ffn.experts.5.w1.weight"] == [32, 32]
    assert shape["layers.1.ffn.experts.5.w1.scale"] == [32, 2]  # one ue8m0 per 32 values along K = 64
    for bf16 in ("layers.1.attn.indexer.wq_b.weight", "layers.1.attn.compressor.wkv.weight", "layers.1.ffn.gate.weight",
                 "embed.weight", "head.weight"):
        assert dt[bf16] == "BF16", bf16
    mtp = {n for n in dt if n.startswith("mtp.0.")}
    for name in ("mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
                 "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.scale",
                 "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.0.w2.scale", "mtp.0.ffn.shared_experts.w3.weight"):
        assert name in mtp, name
    assert not any("compressor" in n for n in mtp)  # the MTP slot of compress_ratios is 0: sliding only
    with safe_open(str(quantized["fp8"] / "model.safetensors"), "pt") as f:
        assert f.get_slice("layers.1.ffn.experts.5.w1.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.1.attn.wq_b.scale").get_dtype() == "F32"  # Base: float32 block scales


@pytest.mark.parametrize("quant", ["fp8", "fp8-fp4"])
def test_cpu_dequantizes_at_load_and_equals_the_stored_model_on_the_references(quantized, quant):
    """dequantize-at-load (CPU default) vs weights kept as stored and dequantized inside each op by
    the torch references: the same values, so the same logits bit for bit."""
    path = quantized[quant]
    deq, stored = load_model(path, torch.float32), load_model(path, torch.float32, quantized=True)
    assert deq.layers[1].attn.wq_a.weight.dtype == torch.float32 and deq.layers[1].attn.wq_a.scale is None
    assert stored.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert stored.layers[1].ffn.experts_w1.dtype == (torch.int8 if quant == "fp8-fp4" else torch.float8_e4m3fn)
    assert stored.layers[1].ffn.experts_w1_scale.dtype == (torch.uint8 if quant == "fp8-fp4" else torch.float32)
    assert stored.embed.weight.dtype == torch.float32 and stored.head.weight.dtype == torch.float32
    assert len(deq.mtp_weights) > 40 and {n for n in stored.mtp_weights if not n.endswith(".scale")} == set(deq.mtp_weights)
    assert stored.mtp_weights["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    ids = list(range(7, 47))
    assert torch.equal(incremental_logits(deq, ids, chunks=[30]), incremental_logits(stored, ids, chunks=[30]))


def _rewrite(src, dst, change):
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)


W, S = "layers.2.attn.wo_b.weight", "layers.2.attn.wo_b.scale"
E, ES = "layers.1.ffn.experts.3.w2.weight", "layers.1.ffn.experts.3.w2.scale"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(S), f"FP8 tensor {W} has no .scale"),
    (lambda t: t.pop(ES), f"packed FP4 \\(int8\\) tensor {E} has no .scale"),
    (lambda t: t.__setitem__(S, t[S].view(torch.uint8).repeat(2, 1).view(torch.float8_e8m0fnu)),
     f"{S}: scale shape \\(2, 1\\)"),
    (lambda t: t.__setitem__(ES, t[ES][:, :0]), f"{ES}: scale shape"),
    (lambda t: t.__setitem__(S, torch.full((1, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)),
     f"{S}: scale has NaN"),
    (lambda t: t.__setitem__(S, torch.full((1, 1), float("inf"))), f"{S}: scale has NaN, inf"),
    (lambda t: t.__setitem__(S, torch.ones(1, 1, dtype=torch.bfloat16)), f"{S}: scale dtype torch.bfloat16"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.scale_extra.scale", torch.ones(1, 1)), "without a weight"),
])
def test_malformed_scales_are_refused_naming_the_tensor(quantized, tmp_path, change, message):
    _rewrite(quantized["fp8-fp4"], tmp_path, change)
    for quantize in (False, True):
        with pytest.raises(WeightsError, match=message):
            load_model(tmp_path, torch.float32, quantized=quantize)


def test_sharded_load_streams_shard_by_shard_with_progress(quantized, tmp_path, caplog):
    tensors = load_file(str(quantized["fp8-fp4"] / "model.safetensors"))
    names = sorted(tensors)
    shards = {f"model-0000{i}-of-00003.safetensors": {n: tensors[n] for n in names[i::3]} for i in range(3)}
    for fname, part in shards.items():  # weights and their scales land in different shards
        save_file(part, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in shards.items() for n in part}}))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(quantized["fp8-fp4"] / f, tmp_path / f)
    with caplog.at_level(logging.INFO, logger="engine.models.weights"):
        got = dict(iter_checkpoint(tmp_path, dequantize=False))
    lines = [r.getMessage() for r in caplog.records if "shard" in r.getMessage()]
    assert len(lines) == 3 and lines[-1].startswith("weights: shard 3/3")
    assert all(k in lines[-1] for k in ("tensors", "GB", "GB/s", "ETA"))
    assert got[ES].dtype == torch.uint8 and got[S].dtype == torch.float32  # the forms the kernels read
    assert set(got) == set(tensors)


def test_quantization_config_is_checked():
    raw = build_config("tiny", quant="fp8-fp4")
    with pytest.raises(ConfigError, match="weight_block_size"):
        parse_config({**raw, "quantization_config": {**raw["quantization_config"], "weight_block_size": [64, 64]}})
    with pytest.raises(ConfigError, match="expert_dtype 'fp4' needs a quantization_config"):
        parse_config({k: v for k, v in raw.items() if k != "quantization_config"})


def test_memory_after_load_is_the_stored_bytes_plus_the_documented_extras(quantized):
    """Kept as stored: every tensor's stored bytes, except the documented widenings: ue8m0 FP8 block
    scales held as float32 (x4), the network's norm weights kept float32 (x2 of bf16), tid2eid as
    int64 (x2 of int32); plus the two RoPE frequency tables."""
    path = quantized["fp8-fp4"]
    model = load_model(path, torch.bfloat16, quantized=True)
    want = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            n, dt = torch.Size(t.get_shape()).numel(), t.get_dtype()
            size = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "F8_E8M0": 1, "I32": 4}[dt]
            fp8_block_scale = dt == "F8_E8M0" and ".experts." not in name
            model_norm = dt == "BF16" and name.endswith("norm.weight") and not name.startswith("mtp.")  # MTP: as loaded
            widened = fp8_block_scale or model_norm or name.endswith("tid2eid")
            want += n * (4 if fp8_block_scale else 2 * size if widened else size)
    want += (model.main_inv_freq.numel() + model.compress_inv_freq.numel()) * 4
    from engine.models.loading import device_bytes

    assert device_bytes(model) == want


def test_bf16_tensor_where_the_config_says_fp8_is_refused(quantized, tmp_path):
    def to_bf16(t):
        t["layers.1.attn.wq_a.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
        del t["layers.1.attn.wq_a.scale"]

    _rewrite(quantized["fp8-fp4"], tmp_path, to_bf16)
    with pytest.raises(WeightsError, match="layers.1.attn.wq_a.weight: checkpoint dtype torch.bfloat16"):
        load_model(tmp_path, torch.float32, quantized=True)


def test_cli_writes_the_quantized_formats(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "tools.make_tiny_checkpoint", str(tmp_path), "--quant", "fp8-fp4"], check=True,
                   capture_output=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.ffn.experts.0.w1.weight").get_dtype() == "I8"


@pytest.mark.slow
def test_flash_shaped_quantized_checkpoint_has_whole_blocks_and_loads(tmp_path):
    """V4-Flash's per-layer dimensions (every FP8 dimension a multiple of 128): sharded write, stored load."""
    out = write_checkpoint(tmp_path, "flash-shaped", quant="fp8-fp4", override={
        "num_hidden_layers": 1, "compress_ratios": [4], "n_routed_experts": 2, "num_experts_per_tok": 2,
        "num_hash_layers": 0, "vocab_size": 4096})
    assert (out / "model.safetensors.index.json").exists()
    model = load_model(out, torch.bfloat16, quantized=True)
    attn, ffn = model.layers[0].attn, model.layers[0].ffn
    assert attn.wq_b.weight.shape == (32768, 1024) and attn.wq_b.scale.shape == (256, 8)
    assert attn.wo_a.scale.shape == (64, 32)  # 8 groups x 1024 rows: whole 128-row blocks per group
    assert ffn.experts_w1.shape == (2, 2048, 2048) and ffn.experts_w1_scale.shape == (2, 2048, 128)
    assert ffn.experts_w2.shape == (2, 4096, 1024) and model.mtp_weights["mtp.0.e_proj.scale"].shape == (32, 32)


@pytest.mark.parametrize("quant, variant", [("fp8", None), ("fp8-fp4", None), ("fp8-fp4", "moe_gemv"),
                                            ("fp8-fp4", "indexer_select")])
def test_stored_model_on_fused_kernels_is_within_bf16_of_the_float32_model(quantized, quant, variant, monkeypatch):
    """The model kept as stored in bf16, every fused kernel on (the FP8 linear, the MoE reading FP8 /
    MXFP4; the interpreter on the CPU) vs the same checkpoint dequantized into a float32 model on the
    references: the bf16 tolerance of test_model (median 2e-2, 90th percentile 3e-2 of the logit
    scale). Not vs the bf16 references: the interpreter multiplies the dequantized weights in
    float32, so where Base's float32 scales make bf16 round, it is the closer of the two. variant: a kernel
    variant on too (moe_gemv: the decodes' MXFP4 MoE as GEMVs, their router aligning nothing; indexer_select: the
    CSA layer's picks by what each token sees, its radix select for the decodes that see more than top-k, 4, here:
    its sort bound lowered to 4)."""
    import kernels
    from kernels import fused, fused_moe, indexer_select, variants

    if variant:
        monkeypatch.setattr(variants, "_on", variants._on | {variant})
        module, name = (fused_moe, "moe_experts_gemv") if variant == "moe_gemv" else (fused, "indexer_topk_select")
        calls, real = [], getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
        monkeypatch.setattr(indexer_select, "SORT_SEEN", 4)
    model = load_model(quantized[quant], torch.bfloat16, quantized=True)
    # a 16-token chunk (groups of both ratios close at 15, the window of 8 slides), then 5 decodes (a
    # ratio-4 group closes at 19); under the interpreter the chunk's rows are most of the time
    ids = torch.randint(5, model.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    want = incremental_logits(load_model(quantized[quant], torch.float32), ids, chunks=[16])
    try:
        kernels.set_backend("fused")
        assert kernels.linear.__module__ == "kernels.fused"
        got = incremental_logits(model, ids, chunks=[16])
    finally:
        kernels.set_backend("auto")
    err = (got - want).abs().max(dim=-1).values / want.abs().max()
    assert err.median() <= 2e-2 and err.quantile(0.9) <= 3e-2, err
    if variant:
        assert calls, f"the steps took {variant}"
