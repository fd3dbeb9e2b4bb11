"""The prefill MoE through unpacked experts and grouped GEMMs (kernels/moe_grouped.py) vs the reference,
in every stored format, with experts that get no rows and pairs another rank computes; the MXFP4 unpack
bit-exact against the formats' dequantizer; and when the dispatcher takes this path."""

import pytest
import torch

from kernels import fused_moe, moe_grouped, quant_configs
from kernels import reference as ref
from kernels.formats import dequantize_mxfp4
from kernels.moe_grouped import moe_experts_grouped
from kernels.mxfp4_unpack import mxfp4_unpacked
from tests.kernels.test_moe import _stored_experts


def test_mxfp4_unpack_is_the_dequantizer():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 256, generator=g) * torch.logspace(-3, 2, 256)  # every scale range, rows off 64
    q, s = _stored_experts(w, "mxfp4")
    q = q.clone()  # 16-byte aligned storage
    got = mxfp4_unpacked(q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 40, 256)
    assert torch.equal(got, dequantize_mxfp4(q, s).to(torch.bfloat16))


def _experts(fmt, E, D, I, g):
    raw = [torch.randn(E, I, D, generator=g) / D**0.5, torch.randn(E, I, D, generator=g) / D**0.5,
           torch.randn(E, D, I, generator=g) / I**0.5]
    if fmt == "dense":
        return [r.to(torch.bfloat16) for r in raw], None
    stored = [_stored_experts(r, fmt) for r in raw]
    return [w.clone() for w, _ in stored], tuple(s for _, s in stored)


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
@pytest.mark.parametrize("skipped", [False, True])
def test_grouped_moe_matches_reference(fmt, skipped):
    """300 tokens, top-3 of 8 experts (one expert never routed to); skipped: a third of the pairs are
    another rank's (-1), which add nothing. Bound: bf16 rounding of the GEMM outputs and summation order;
    Triton's interpreter rounds float32 to bf16 by truncation (the GPU to nearest), which the unpacked FP8
    weights show most, hence FP8's wider bound (the fused MoE tests' own)."""
    T, D, I, E, k = 300, 256, 128, 8, 3
    g = torch.Generator().manual_seed(11 + skipped)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, w3, w2), scales = _experts(fmt, E, D, I, g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1: no rows
    if skipped:
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.33, -1, idx)
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    got = moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales)
    tol = 3e-2 if fmt == "fp8" else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max().item()
    if skipped:
        none = (idx < 0).all(1)
        assert none.any() and got[none].abs().max() == 0


def test_dispatch_takes_grouped_path_when_rows_repay_unpacking(monkeypatch):
    """moe_experts_fused hands a prefill-sized call to the grouped path once its experts average the
    format's MOE_GROUPED_MIN_ROWS, at any expert count (chunks of experts past the scratch bound); decode-sized
    calls and fewer rows per expert stay on the fused kernels."""
    calls = []
    monkeypatch.setattr(fused_moe, "GROUPED_OK", True)
    monkeypatch.setattr(fused_moe, "moe_experts_grouped", lambda *a, **kw: calls.append(a[0].shape[0]) or a[0])
    E, D, I, k = 16, 4096, 2048, 6
    mx = (torch.empty(E, I, D // 2, dtype=torch.int8), torch.empty(E, D, I // 2, dtype=torch.int8))
    sc = (torch.empty(E, I, D // 32, dtype=torch.uint8), torch.empty(E, D, I // 32, dtype=torch.uint8))
    x = torch.zeros(1024, D, dtype=torch.bfloat16)  # 6144 pairs: 384 rows per expert
    idx = torch.zeros(1024, k, dtype=torch.long)
    fused_moe.moe_experts_fused(x, mx[0], mx[0], mx[1], idx.float(), idx, 10.0, (sc[0], sc[0], sc[1]))
    assert calls == [1024]
    assert not quant_configs.moe_grouped(900, 16, "dense")  # decode tiles
    assert quant_configs.moe_grouped(2048, 16, "dense") and not quant_configs.moe_grouped(1536, 16, "mxfp4")
    # all 256 experts on one GPU (4 GB unpacked: 8 chunks): from 512 rows per expert, not below
    assert quant_configs.moe_grouped(512 * 256, 256, "mxfp4") and not quant_configs.moe_grouped(511 * 256, 256, "mxfp4")


def test_grouped_rule_reads_the_entry_of_the_call_s_expert_count(monkeypatch):
    """MOE_GROUPED_MIN_ROWS per expert count: the largest listed count at or below the call's experts
    (the first below it), and an entry of None keeps that count on the fused kernels at any size."""
    monkeypatch.setitem(quant_configs.MOE_GROUPED_MIN_ROWS, "mxfp4", ((16, 160), (64, 96), (256, None)))
    rows = quant_configs.moe_grouped_min_rows
    assert [rows(e, "mxfp4") for e in (8, 16, 32, 64, 128, 255, 256, 512)] == [160, 160, 160, 96, 96, 96, None, None]
    assert quant_configs.moe_grouped(100 * 64, 64, "mxfp4") and not quant_configs.moe_grouped(100 * 32, 32, "mxfp4")
    assert not quant_configs.moe_grouped(10_000 * 256, 256, "mxfp4")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_chunked_experts_give_the_unchunked_result(fmt):
    """More experts than one unpacked weight may hold go through in chunks (max_bytes: 3 experts' weight, so
    chunks of 3, 3 and 2 over 8 experts): every pair is computed once, by its own expert, the same sums as one
    chunk; pairs of another rank (-1) and an expert without rows included."""
    T, D, I, E, k = 200, 256, 128, 8, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, w3, w2), scales = _experts(fmt, E, D, I, g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx)
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    whole = moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales)
    chunked = moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales, max_bytes=3 * I * D * 2 + 1)
    assert torch.equal(chunked, whole)
    assert moe_grouped.experts_per_chunk(E, I, D, 3 * I * D * 2 + 1) == 3
    assert moe_grouped.experts_per_chunk(E, I, D, 1) == 1 and moe_grouped.experts_per_chunk(E, I, D, 1 << 40) == E
