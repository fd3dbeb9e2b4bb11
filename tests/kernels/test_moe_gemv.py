"""The MXFP4 MoE at decode's few rows as GEMVs (kernel variant moe_gemv, kernels/moe_gemv.py) in Triton's interpreter
against the reference: every token count it takes, pairs of another rank (-1) and experts without rows, K split so
that the last split joins the partials, the shared expert added in the sum; and which calls the variant takes."""

import pytest
import torch

from kernels import fused_moe, moe_gemv, variants
from kernels import reference as ref
from kernels.fused_moe import aligned_rows, moe_experts_fused
from tests.kernels.test_moe import _stored_experts


def _mxfp4_experts(E, D, I, g):
    w1, s1 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w3, s3 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w2, s2 = _stored_experts(torch.randn(E, D, I, generator=g) / I**0.5, "mxfp4")
    return (w1.clone(), w3.clone(), w2.clone()), (s1, s3, s2)  # clones: 16-byte aligned storage


def _two_tokens(seed, idx, D=256, I=128, E=4):
    """Two tokens routed to `idx` [2, k] over E MXFP4 experts: x, the experts, their scales, routing weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, D, generator=g).to(torch.bfloat16)
    experts, scales = _mxfp4_experts(E, D, I, g)
    return x, experts, scales, torch.rand(*idx.shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("T, skipped, shared", [(1, False, False), (3, True, False), (4, False, True)])
def test_gemv_moe_is_the_reference(T, skipped, shared, monkeypatch):
    """Bound: bf16 rounding of h and of the output, float32 sums in another order (the MMA path's own bound)."""
    monkeypatch.setattr(variants, "_on", frozenset({"moe_gemv"}))
    D, I, E, k = 256, 160, 8, 3  # I off the 64-wide N tile and the K step: partial tiles both ways
    g = torch.Generator().manual_seed(T + 10 * skipped)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, w3, w2), scales = _mxfp4_experts(E, D, I, g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1: no rows
    if skipped:
        idx[0, 1] = -1
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    add = torch.randn(T, D, generator=g).to(torch.bfloat16) if shared else None
    calls = []
    real = moe_gemv.moe_experts_gemv
    monkeypatch.setattr(fused_moe, "moe_experts_gemv", lambda *a, **kw: calls.append(T) or real(*a, **kw))
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, shared=add)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    if shared:
        want = (want.float() + add.float()).to(torch.bfloat16)
    assert calls == [T]
    assert (got.float() - want.float()).abs().max() <= 2e-2 * max(want.abs().max().item(), 1.0)
    assert aligned_rows(x, w1, scales, T * k) is None  # the router aligns nothing for it


def test_the_gemv_joins_k_splits_in_the_last_split():
    """K split in two (the interpreter's choice wherever two K steps allow it): the join gives the one-split sum."""
    idx = torch.tensor([[0, 3], [2, 0]])
    x, (w1, w3, w2), scales, w = _two_tokens(5, idx)
    D = x.shape[1]
    assert moe_gemv._splits(10, D, moe_gemv.INTERPRET_TILES["BLOCK_K"])[0] == 2
    assert moe_gemv._splits(10, D, D)[0] == 1
    split = moe_gemv.moe_experts_gemv(x, w1, w3, w2, scales, w, idx, 10.0)
    whole = moe_gemv.moe_experts_gemv(x, w1, w3, w2, scales, w, idx, 10.0, tiles={**moe_gemv.TILES, "BLOCK_K": D})
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-6)


def test_which_calls_the_variant_takes(monkeypatch):
    w = torch.zeros(8, 2048, 2048, dtype=torch.int8)
    s = torch.zeros(8, 2048, 128, dtype=torch.uint8)
    assert moe_gemv.takes(1, w, s) and moe_gemv.takes(moe_gemv.MOE_GEMV_MAX_ROWS, w, s)
    assert not moe_gemv.takes(moe_gemv.MOE_GEMV_MAX_ROWS + 1, w, s) and not moe_gemv.takes(0, w, s)
    assert not moe_gemv.takes(1, w.to(torch.bfloat16), None)  # bf16 experts: the MMA kernels
    assert not moe_gemv.takes(1, torch.zeros(8, 2048, 1000, dtype=torch.int8), s)  # K off the 32-value groups
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert fused_moe._gemv(x, w, (s, s, s)) == ("moe_gemv" in variants.DEFAULT)  # on by default
    monkeypatch.setattr(variants, "_on", frozenset({"moe_gemv"}))
    assert fused_moe._gemv(x, w, (s, s, s))
    monkeypatch.setattr(variants, "_on", frozenset())
    assert not fused_moe._gemv(x, w, (s, s, s))


def test_a_sweep_config_runs_the_gemv_in_its_tiles():
    """tools/bench_quant.py --mx-ab's GEMV candidates: config {"gemv": tiles} runs kernels/moe_gemv.py whatever the
    variant says, in those tiles as given, and gives the reference's result."""
    idx = torch.tensor([[1, 3], [3, 0]])
    x, (w1, w3, w2), scales, w = _two_tokens(9, idx)
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, config={"gemv": {**moe_gemv.TILES, "BLOCK_N": 16}})
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * max(want.abs().max().item(), 1.0)
