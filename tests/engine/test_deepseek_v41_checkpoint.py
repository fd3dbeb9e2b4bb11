"""Random DeepSeek-V4.1 checkpoints in the official layout, bf16 and as V4.1 ships them (FP8 32x32
tiles, packed FP4 experts, FP8 Engram rows): both load; the stored formats dequantize to the bf16
weights within their rounding."""

from __future__ import annotations

import pytest
import torch

from engine.config_v41 import RELEASED_INDEX_SOURCES, RELEASED_KV_SOURCES, RELEASED_RATIOS, parse_v41_config
from engine.loader_v41 import load_v41_model
from engine.random_checkpoint_v41 import build_text_config, write_v41_checkpoint
from engine.weights import WeightsError
from engine.weights_v41 import dequantize_fp8_tiles, mxfp4_experts, quantize_fp8_tiles
from tests.engine.v41_oracle import one_shot

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41")
    return {q: write_v41_checkpoint(root / q, "v41-tiny", seed=3, quant=q) for q in ("bf16", "fp8-fp4")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_shipped_formats_load_close_to_bf16(checkpoints):
    ref = load_v41_model(checkpoints["bf16"], torch.float32)
    q = load_v41_model(checkpoints["fp8-fp4"], torch.float32)
    assert q.cfg.fp8_linears and q.cfg.expert_dtype == "fp4" and q.cfg.weight_block_size == (32, 32)
    a, b = dict(ref.named_parameters()), dict(q.named_parameters())
    assert a.keys() == b.keys()
    for name in ("layers.3.attn.wq_b.weight", "layers.6.ffn.shared_experts.w2.weight", "layers.1.engram.wkv.weight",
                 "layers.4.engram.embed.weight"):
        assert 0 < _rel(b[name], a[name]) < 0.05, name  # FP8 e4m3: ~2-3% relative
    assert 0 < _rel(b["layers.2.ffn.experts_w1"], a["layers.2.ffn.experts_w1"]) < 0.2  # FP4 e2m1
    assert torch.equal(b["layers.2.attn.compressor.wkv.weight"], a["layers.2.attn.compressor.wkv.weight"])  # bf16 kept
    assert torch.isfinite(one_shot(q.double(), torch.arange(5, 60).tolist())).all()


def test_fp8_tiles_round_trip_and_refuse_a_wrong_tiling():
    w = torch.randn(100, 70)
    q, s = quantize_fp8_tiles(w, 32)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3)
    assert _rel(dequantize_fp8_tiles(q, s, 32), w) < 0.05
    with pytest.raises(ValueError, match="32x32 blocks"):
        dequantize_fp8_tiles(q, s[:, :2], 32)


def test_flash_shaped_preset_keeps_the_released_schedule(tmp_path):
    from engine.random_checkpoint import write_tokenizer

    write_tokenizer(tmp_path)
    text = build_text_config("v41-flash-shaped", tmp_path / "tokenizer.json")
    cfg = parse_v41_config({"model_type": "deepseek_v41", "text_config": text})
    assert list(cfg.compress_ratios) == RELEASED_RATIOS and list(cfg.kv_source_layer_ids) == RELEASED_KV_SOURCES
    assert list(cfg.index_source_layer_ids) == RELEASED_INDEX_SOURCES and cfg.candidate_source_layer_id == 20
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank) == (5120, 64, 512, 1280)
    assert cfg.engram_layer_ids == (1, 14) and cfg.last_kv_source == 20


def test_mxfp4_experts_kept_as_stored_give_the_dequantized_logits(checkpoints):
    """On CUDA the routed experts stay packed (e2m1 pairs + ue8m0 bytes, a quarter of bf16's bytes)
    for the fused MoE; here the same model built that way runs the MoE on them (the reference
    kernels dequantize inside) and gives the logits of the model dequantized at load. The FP8
    32x32 linears are dequantized either way (the FP8 kernels read 128x128 blocks)."""
    ck = checkpoints["fp8-fp4"]
    assert mxfp4_experts(ck) and not mxfp4_experts(checkpoints["bf16"])
    dq = load_v41_model(ck, torch.float32)  # the CPU default
    st = load_v41_model(ck, torch.float32, experts_as_stored=True)
    ffn = st.layers[2].ffn
    assert ffn.experts_w1.dtype == torch.int8 and ffn.experts_w1_scale.dtype == torch.uint8
    assert ffn.experts_w1.numel() * 2 == dq.layers[2].ffn.experts_w1.numel()  # two values per byte
    assert st.layers[3].attn.wq_b.weight.dtype == torch.float32  # FP8 32x32: dequantized
    ids = torch.arange(5, 60).tolist()
    a, b = one_shot(dq.double(), ids), one_shot(st.double(), ids)
    # the packed path's MoE works in float32 (kernels.reference dequantizes there): float32 rounding, not more
    assert (a - b).abs().max() <= 1e-6 * a.abs().max()
    with pytest.raises(WeightsError, match="experts_as_stored needs MXFP4"):
        load_v41_model(checkpoints["bf16"], torch.float32, experts_as_stored=True)
