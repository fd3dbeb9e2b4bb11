"""The prefill MoE through unpacked experts and grouped GEMMs (kernels/moe_grouped.py) vs the reference,
in every stored format, with experts that get no rows and pairs another rank computes; the MXFP4 unpack
bit-exact against the formats' dequantizer; and when the dispatcher takes this path."""

import pytest
import torch

from kernels import fused_moe, quant_configs
from kernels import reference as ref
from kernels.formats import dequantize_mxfp4
from kernels.moe_grouped import moe_experts_grouped, unpack_ahead
from kernels.mxfp4_unpack import UnpackTiles, mxfp4_unpacked
from tests.kernels.test_moe import _stored_experts


def test_mxfp4_unpack_is_the_dequantizer():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 256, generator=g) * torch.logspace(-3, 2, 256)  # every scale range, rows off 64
    q, s = _stored_experts(w, "mxfp4")
    q = q.clone()  # 16-byte aligned storage
    got = mxfp4_unpacked(q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 40, 256)
    assert torch.equal(got, dequantize_mxfp4(q, s).to(torch.bfloat16))


@pytest.mark.parametrize("programs", [1, 3, 7, 18, 40])
def test_grid_limited_unpack_is_the_per_tile_unpack(programs):
    """A few programs striding over all 18 tiles (3 experts x 3 row tiles x 2 K tiles; rows off the tile) write
    what one program per tile writes, bit for bit, whether or not the count divides the tiles or exceeds them."""
    g = torch.Generator().manual_seed(5)
    q, s = _stored_experts(torch.randn(3, 40, 256, generator=g) * torch.logspace(-3, 2, 256), "mxfp4")
    q = q.clone()
    want = mxfp4_unpacked(q, s, UnpackTiles(16, 128))
    assert torch.equal(mxfp4_unpacked(q, s, UnpackTiles(16, 128, programs=programs)), want)


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


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
def test_grouped_moe_on_experts_unpacked_ahead_is_the_same(fmt):
    """The experts unpacked ahead (the grid-limited launch) give the call's own result exactly."""
    T, D, I, E, k = 200, 256, 128, 4, 2
    g = torch.Generator().manual_seed(13)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, w3, w2), scales = _experts(fmt, E, D, I, g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    ahead = unpack_ahead(w1, w3, w2, scales, x.dtype)
    assert ahead.ready is None and ahead.w2.shape == (E, D, I) and ahead.w1.dtype == torch.bfloat16
    want = moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales)
    assert torch.equal(moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales, unpacked=ahead), want)
    swapped = unpack_ahead(w3, w1, w2, scales, x.dtype)  # the call computes from the handle's tensors
    assert not torch.equal(moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales, unpacked=swapped), want)


def test_dispatch_takes_grouped_path_when_rows_repay_unpacking(monkeypatch):
    """moe_experts_fused hands a prefill-sized call to the grouped path once its experts average the
    format's MOE_GROUPED_MIN_ROWS and the unpacked bytes fit; decode-sized calls and huge expert sets stay
    on the fused kernels."""
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
    assert not quant_configs.moe_grouped(900, 16, 0, "dense")  # decode tiles
    assert quant_configs.moe_grouped(2048, 16, 0, "dense") and not quant_configs.moe_grouped(1536, 16, 0, "mxfp4")
    assert not quant_configs.moe_grouped(8192 * 6, 256, 256 * I * D * 2, "mxfp4")  # 4 GB unpacked: fused kernel


def test_takes_grouped_is_the_rule_moe_experts_fused_follows(monkeypatch):
    """With the rule cut to 20 rows per expert: 48 tokens x top-2 over 4 MXFP4 experts go grouped (takes_grouped
    says so, and the call given experts unpacked ahead computes the same as without), 16 tokens do not, and that
    call refuses experts unpacked for it (the unpack would be wasted)."""
    monkeypatch.setattr(fused_moe, "GROUPED_OK", True)
    monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    monkeypatch.setitem(quant_configs.MOE_GROUPED_MIN_ROWS, "mxfp4", ((1, 20),))
    D, I, E, k = 256, 128, 4, 2
    g = torch.Generator().manual_seed(17)
    (w1, w3, w2), scales = _experts("mxfp4", E, D, I, g)
    ahead = unpack_ahead(w1, w3, w2, scales, torch.bfloat16)
    for T, grouped in ((48, True), (16, False)):
        x = torch.randn(T, D, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g).to(torch.bfloat16)
        assert fused_moe.takes_grouped(T, x.dtype, x.device, w1, scales, k) == grouped
        if grouped:
            want = moe_experts_grouped(x, w1, w3, w2, w, idx, 10.0, scales)
            assert torch.equal(fused_moe.moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, unpacked=ahead), want)
            assert torch.equal(fused_moe.moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales), want)
        else:
            with pytest.raises(ValueError, match="does not take the grouped path"):
                fused_moe.moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, unpacked=ahead)
    assert not fused_moe.takes_grouped(48, torch.float32, x.device, w1, scales, k)  # the grouped GEMM runs bf16


def test_moe_unpack_ahead_only_where_the_call_unpacks(monkeypatch):
    """kernels.moe_unpack_ahead (what the model asks before attention) starts an unpack only with the variant on,
    the MoE's kernel bound (not the CPU's references), quantized experts, and a call that goes grouped."""
    import kernels
    from kernels import variants

    monkeypatch.setattr(fused_moe, "GROUPED_OK", True)
    monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    monkeypatch.setitem(quant_configs.MOE_GROUPED_MIN_ROWS, "mxfp4", ((1, 20),))
    D, I, E, k = 256, 128, 4, 2
    (w1, w3, w2), scales = _experts("mxfp4", E, D, I, torch.Generator().manual_seed(19))
    x = torch.zeros(48, D, dtype=torch.bfloat16)
    kernels.set_backend("fused")
    assert kernels.moe_unpack_ahead(x, w1, w3, w2, scales, k) is None  # variant off
    variants.set_variants("unpack_ahead")
    got = kernels.moe_unpack_ahead(x, w1, w3, w2, scales, k)
    assert torch.equal(got.w1, mxfp4_unpacked(w1, scales[0])) and torch.equal(got.w2, mxfp4_unpacked(w2, scales[2]))
    assert kernels.moe_unpack_ahead(x[:16], w1, w3, w2, scales, k) is None  # not grouped
    assert kernels.moe_unpack_ahead(x, got.w1, got.w3, got.w2, None, k) is None  # bf16 experts: nothing to unpack
    kernels.set_backend("auto")  # CPU tensors: the references, which unpack nothing
    assert kernels.moe_unpack_ahead(x, w1, w3, w2, scales, k) is None


def test_grouped_rule_reads_the_entry_of_the_call_s_expert_count(monkeypatch):
    """MOE_GROUPED_MIN_ROWS per expert count: the largest listed count at or below the call's experts
    (the first below it), and an entry of None keeps that count on the fused kernels at any size."""
    monkeypatch.setitem(quant_configs.MOE_GROUPED_MIN_ROWS, "mxfp4", ((16, 160), (64, 96), (256, None)))
    rows = quant_configs.moe_grouped_min_rows
    assert [rows(e, "mxfp4") for e in (8, 16, 32, 64, 128, 255, 256, 512)] == [160, 160, 160, 96, 96, 96, None, None]
    assert quant_configs.moe_grouped(100 * 64, 64, 0, "mxfp4") and not quant_configs.moe_grouped(100 * 32, 32, 0, "mxfp4")
    assert not quant_configs.moe_grouped(10_000 * 256, 256, 0, "mxfp4")
