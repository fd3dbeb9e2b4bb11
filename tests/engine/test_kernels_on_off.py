"""The engine's logits with every fused kernel on vs the torch references, bf16 tolerance."""

import torch

import kernels
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from tests.engine.conftest import KERNELS_TINY, incremental_logits


def test_engine_logits_kernels_on_vs_off(kernels_tiny_dir, single_thread):
    model = load_model(kernels_tiny_dir, torch.bfloat16)  # cut for the interpreter (tests/engine/conftest.py)
    # a 30-token chunk, then 6 decodes (positions 30-35: groups of both ratios close at 31, one of 4 at
    # 35); each decode is three layers of kernel launches under the interpreter
    ids = torch.randint(5, model.cfg.vocab_size, (36,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        kernels.set_backend("ref")
        want = incremental_logits(model, ids, chunks=[30])
        kernels.set_backend("fused")
        assert kernels.paged_attention.__module__ == "kernels.fused_attention"
        got = incremental_logits(model, ids, chunks=[30])
    finally:
        kernels.set_backend("auto")
    err = (got - want).abs().max(dim=-1).values / want.abs().max()
    # bf16 tolerance as in the model tests: median 2e-2, 90th percentile 3e-2 of the logit scale
    assert err.median() <= 2e-2 and err.quantile(0.9) <= 3e-2, err


def test_engine_logits_with_every_fusion_on(kernels_tiny_dir, single_thread):
    """kernels/fusions.py's launch-saving fusions (Mega-mHC, Mega-Gate, the shared expert in the top-k
    sum) and kernels/variants.py's kernel variants (norm + RoPE tiles, bf16 mHC mixing) in a prefill chunk and
    two decodes: within the same tolerance of the references."""
    from kernels import fusions, variants

    model = load_model(kernels_tiny_dir, torch.bfloat16)
    ids = torch.randint(5, model.cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        kernels.set_backend("ref")
        want = incremental_logits(model, ids, chunks=[30])
        kernels.set_backend("fused")
        fusions.set_fusions("all")
        variants.set_variants("all")
        got = incremental_logits(model, ids, chunks=[30])
    finally:
        kernels.set_backend("auto")
        fusions.set_fusions(fusions.DEFAULT)
        variants.set_variants(variants.DEFAULT)
    err = (got - want).abs().max(dim=-1).values / want.abs().max()
    assert err.median() <= 2e-2 and err.quantile(0.9) <= 3e-2, err


def test_prefill_with_experts_unpacked_ahead_is_the_same(tmp_path, single_thread, monkeypatch):
    """Kernel variant unpack_ahead in a model as V4-Flash stores it (MXFP4 experts, K 128 for the unpack's tile), with
    the grouped-path rule cut so the 30-token prefill's MoE goes grouped and the decode's does not: each layer's
    experts are unpacked ahead (and only in the prefill: a decode handed them would refuse), the logits the same
    bits as without."""
    from kernels import fused_moe, moe_grouped, quant_configs, variants

    monkeypatch.setattr(fused_moe, "GROUPED_OK", True)
    monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    monkeypatch.setitem(quant_configs.MOE_GROUPED_MIN_ROWS, "mxfp4", ((1, 4),))  # 60 pairs over 8 experts: grouped
    grouped, ahead = [], []  # per grouped call: whether it was handed experts unpacked ahead; per unpack_ahead: 1
    run_grouped, start = moe_grouped.moe_experts_grouped, moe_grouped.unpack_ahead
    monkeypatch.setattr(fused_moe, "moe_experts_grouped", lambda *a: grouped.append(a[8] is not None) or run_grouped(*a))
    monkeypatch.setattr(moe_grouped, "unpack_ahead", lambda *a: ahead.append(1) or start(*a))
    path = write_checkpoint(tmp_path / "flash", "tiny", seed=7, quant="fp8-fp4",
                            override={**KERNELS_TINY, "hidden_size": 128, "moe_intermediate_size": 128})
    model = load_model(path, torch.bfloat16, quantized=True)
    assert model.layers[0].ffn.experts_w1.dtype == torch.int8
    ids = torch.randint(5, model.cfg.vocab_size, (31,), generator=torch.Generator().manual_seed(2)).tolist()
    kernels.set_backend("fused")
    want = incremental_logits(model, ids, chunks=[30])
    assert grouped == [False] * 3 and not ahead  # the prefill's three layers grouped, nothing ahead
    variants.set_variants("unpack_ahead")
    got = incremental_logits(model, ids, chunks=[30])
    assert grouped[3:] == [True] * 3 and len(ahead) == 3
    assert torch.equal(got, want)
