"""The engine's logits with every fused kernel on vs the torch references, bf16 tolerance."""

import torch

import kernels
from engine.models.deepseek_v4.loader import load_model
from tests.engine.conftest import incremental_logits


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
