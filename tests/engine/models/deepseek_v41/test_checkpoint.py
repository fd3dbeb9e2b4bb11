"""Random DeepSeek-V4.1 checkpoints in the official layout, bf16 and as V4.1 ships them (FP8 32x32
tiles, packed FP4 experts, FP8 Engram rows): both load; the stored formats dequantize to the bf16
weights within their rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.deepseek_v41.config import (
    RELEASED_INDEX_SOURCES,
    RELEASED_KV_SOURCES,
    RELEASED_RATIOS,
    parse_v41_config,
)
from engine.models.deepseek_v41.loader import load_model
from engine.models.deepseek_v41.random_checkpoint import build_text_config, write_v41_checkpoint
from engine.models.deepseek_v41.weights import check_fp8_tiles, mxfp4_experts
from engine.models.weights import WeightsError
from kernels.formats import dequantize_fp8_block, fp8_block_of, quantize_fp8_block
from tests.engine.models.deepseek_v41.oracle import greedy, one_shot

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41")
    return {q: write_v41_checkpoint(root / q, "v41-tiny", seed=3, quant=q) for q in ("bf16", "fp8-fp4")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_shipped_formats_load_close_to_bf16(checkpoints):
    ref = load_model(checkpoints["bf16"], torch.float32)
    q = load_model(checkpoints["fp8-fp4"], torch.float32)
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
    q, s = quantize_fp8_block(w, block=32)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3) and fp8_block_of(q.shape, s.shape) == 32
    assert _rel(dequantize_fp8_block(q, s), w) < 0.05
    check_fp8_tiles(q, s, 32)
    with pytest.raises(WeightsError, match="in 128x128 blocks"):
        check_fp8_tiles(q, s, 128)
    with pytest.raises(ValueError, match="blocks of 128 or 32"):
        dequantize_fp8_block(q, s[:, :2])


def test_flash_shaped_preset_keeps_the_released_schedule(tmp_path):
    from engine.models.deepseek_v4.random_checkpoint import write_tokenizer

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
    32x32 linears stay dequantized here (the CPU default; kept as stored: the next test)."""
    ck = checkpoints["fp8-fp4"]
    assert mxfp4_experts(ck) and not mxfp4_experts(checkpoints["bf16"])
    dq = load_model(ck, torch.float32)  # the CPU default
    st = load_model(ck, torch.float32, experts_as_stored=True)
    ffn = st.layers[2].ffn
    assert ffn.experts_w1.dtype == torch.int8 and ffn.experts_w1_scale.dtype == torch.uint8
    assert ffn.experts_w1.numel() * 2 == dq.layers[2].ffn.experts_w1.numel()  # two values per byte
    assert st.layers[3].attn.wq_b.weight.dtype == torch.float32  # FP8 32x32: dequantized
    ids = torch.arange(5, 60).tolist()
    a, b = one_shot(dq.double(), ids), one_shot(st.double(), ids)
    # the packed path's MoE works in float32 (kernels.reference dequantizes there): float32 rounding, not more
    assert (a - b).abs().max() <= 1e-6 * a.abs().max()
    with pytest.raises(WeightsError, match="experts_as_stored needs MXFP4"):
        load_model(checkpoints["bf16"], torch.float32, experts_as_stored=True)


def test_fp8_linears_kept_as_stored_give_the_dequantized_tokens(checkpoints):
    """V4.1's FP8 32x32 linears kept as e4m3 + float32 tile scales (the CUDA default, for the FP8
    kernels; here on the CPU, where kernels.reference dequantizes each per call) against the same
    checkpoint dequantized at load, in float32: the same greedy tokens through chunked prefill and
    decode, logits within 1e-6 of their scale (seen: equal; both dequantize in float32). Every FP8
    linear the checkpoint stores is kept; the FP8 Engram tables stay dequantized (a gather)."""
    from engine.models.deepseek_v41.names import official_name, to_official
    from engine.models.deepseek_v41.random_checkpoint import FP8_LINEAR

    ck = checkpoints["fp8-fp4"]
    dq = load_model(ck, torch.float32)
    st = load_model(ck, torch.float32, linears_as_stored=True)
    kept = {n for n, p in st.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert kept == {n for n, _ in dq.named_parameters() if FP8_LINEAR.search(n)} and len(kept) == 10 * 8 + 2
    wq_b = st.layers[3].attn.wq_b
    assert wq_b.scale.dtype == torch.float32 and tuple(wq_b.scale.shape) == (4 * 64 // 32, 32 // 32)
    assert st.layers[1].engram.embed.weight.dtype == torch.float32
    a = st.layers[3].attn  # wq_a over wkv (32 rows: one 32-row block) stacked: one launch
    assert a.wq_a.stacked.members == (a.wq_a, a.wkv) and a.wkv.weight.data_ptr() == a.wq_a.stacked.weight[32:].data_ptr()
    ids = torch.arange(5, 60).tolist()
    ta, la = greedy(dq, ids, chunk=24, steps=5, dtype=torch.float32)
    tb, lb = greedy(st, ids, chunk=24, steps=5, dtype=torch.float32)
    assert ta == tb and (la - lb).abs().max() <= 1e-6 * la.abs().max()
    # transformers' names: a kept linear's scale follows its weight's name
    assert official_name("model.layers.3.self_attn.q_b_proj.weight") == "layers.3.attn.wq_b.weight"
    assert next(to_official("model.layers.3.mlp.shared_experts.down_proj.scale", wq_b.scale))[0] == \
        "layers.3.ffn.shared_experts.w2.scale"
    with pytest.raises(WeightsError, match="linears_as_stored needs FP8"):
        load_model(checkpoints["bf16"], torch.float32, linears_as_stored=True)


def test_fp8_linears_through_the_fused_kernels_equal_the_references(checkpoints, monkeypatch):
    """The kept FP8 32x32 linears through the FP8 kernels (TRITON_INTERPRET=1: the dispatch's linear,
    stacked pair and grouped wo_a bound to them, every other op the reference): the same greedy tokens
    and logits within 1e-5 of the logit scale in float32 (the kernels' float32 dot)."""
    import kernels
    from kernels import fused

    st = load_model(checkpoints["fp8-fp4"], torch.float32, linears_as_stored=True)
    ids = torch.arange(5, 25).tolist()  # a 20-row prefill (the dequant GEMV), then a decode step (the gemv)
    want_tokens, want = greedy(st, ids, chunk=24, steps=2, dtype=torch.float32)
    for name in ("linear", "linear_split", "grouped_linear"):
        monkeypatch.setattr(kernels, name, fused.FUSED[name])
    got_tokens, got = greedy(st, ids, chunk=24, steps=2, dtype=torch.float32)
    assert got_tokens == want_tokens and (got - want).abs().max() <= 1e-5 * want.abs().max()
    # a 70-row chunk: past the GEMV rows, where the tables pick the tensor-core kernel and a 32x32
    # weight is unpacked for torch's GEMM instead (kernels/fp8_unpack.py)
    from kernels import fused_fp8_linear
    from kernels.fp8_unpack import fp8_unpacked

    assert fused_fp8_linear.variant_for(70, 1280, 5120) == "mma"
    long_ids = torch.arange(5, 75).tolist()
    monkeypatch.undo()
    want_tokens, want = greedy(st, long_ids, chunk=80, steps=1, dtype=torch.float32)
    for name in ("linear", "linear_split", "grouped_linear"):
        monkeypatch.setattr(kernels, name, fused.FUSED[name])
    unpacked = []
    monkeypatch.setattr(fused_fp8_linear, "fp8_unpacked", lambda *a: unpacked.append(a[0].shape) or
                        fp8_unpacked(*a))
    got_tokens, got = greedy(st, long_ids, chunk=80, steps=1, dtype=torch.float32)
    assert got_tokens == want_tokens and (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert len(unpacked) >= 10  # the chunk's linears of every layer


def test_fp32_math_weights_are_held_in_fp32_after_loading(checkpoints):
    """hold_fp32_weights: in a bf16 model the router's gate and each pooling compressor's wkv over
    wgate (one matrix, the parameters views into it) are fp32 holding the checkpoint's bf16 values
    exactly, so no decode step converts them; the ratio-1 compressor keeps the model dtype."""
    from safetensors.torch import load_file

    m = load_model(checkpoints["bf16"], torch.bfloat16)
    comp = m.layers[2].attn.compressor
    assert comp.ratio == 2 and comp.pool.dtype == torch.float32 and comp.pool.shape[0] == 2 * comp.wkv.weight.shape[0]
    assert comp.wkv.weight.data_ptr() == comp.pool.data_ptr() and comp.wgate.weight.data_ptr() == comp.pool[
        comp.wkv.weight.shape[0]:].data_ptr()
    stored = {}
    for f in sorted(Path(checkpoints["bf16"]).glob("*.safetensors")):
        stored.update(load_file(str(f)))
    wkv = next(t for n, t in stored.items() if n.endswith("layers.2.attn.compressor.wkv.weight"))
    assert wkv.dtype == torch.bfloat16 and torch.equal(comp.wkv.weight, wkv.float())
    assert m.layers[3].ffn.gate.weight.dtype == torch.float32
    assert m.layers[6].attn.compressor.ratio == 1 and m.layers[6].attn.compressor.pool is None
    assert m.layers[6].attn.compressor.wkv.weight.dtype == torch.bfloat16
