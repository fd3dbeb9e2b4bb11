"""DeepSeek-V4.1's fused ops (kernels.v41_*) against their torch references in kernels/deepseek_v41/reference.py
(TRITON_INTERPRET=1 on CPU). Awkward sizes, one-token batches; tolerances stated."""

import pytest
import torch

import kernels
from kernels import fused
from kernels import reference as ref_v4
from kernels.deepseek_v41 import reference as ref
from kernels.reference import local_experts

# bf16: Triton's interpreter truncates float32 -> bf16 casts (the GPU rounds to nearest), so a value cast
# twice (V4.1's norm) can sit two bf16 steps off the reference here: 2e-2 of the scale, as tests/kernels/* use
BF16 = 2e-2


def _rel(got, want):
    return ((got.float() - want.float()).abs().max() / max(want.float().abs().max(), 1.0)).item()


@pytest.mark.parametrize("T, D", [(1, 24), (17, 40), (3, 2100)])  # the last: many K splits, several D tiles
def test_hc_site_collapse_matches_reference(T, D):
    """pre / post / comb within fp32 rounding (1e-5), the collapse with the PREVIOUS site's pre (not
    this one's) within bf16 rounding of h's dtype."""
    torch.manual_seed(T)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, BF16)):
        h = torch.randn(T, 4, D).to(dtype)
        pre_in = torch.rand(T, 4)
        fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
        got = fused.FUSED["v41_hc_site_collapse"](h, pre_in, fn, base, scale, 1e-6, 1e-6, 20)
        want = ref.hc_site_collapse(h, pre_in, fn, base, scale, 1e-6, 1e-6, 20)
        for name, g, w in zip(("pre", "post", "comb"), got[:3], want[:3]):
            assert g.dtype == torch.float32 and g.shape == w.shape
            assert _rel(g, w) <= 1e-5, (name, _rel(g, w))
        assert got[3].dtype == dtype and _rel(got[3], want[3]) <= tol, _rel(got[3], want[3])
        assert _rel(got[3], ref.hc_collapse(h, got[0])) > 10 * tol  # collapsed with pre_in, not its own pre


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, BF16)])
def test_hc_expand_matches_reference(dtype, tol):
    T, D = 5, 70
    out, h = torch.randn(T, D).to(dtype), torch.randn(T, 4, D).to(dtype)
    post, comb = torch.rand(T, 4) * 2, torch.rand(T, 4, 4)
    got = fused.FUSED["v41_hc_expand"](out, h, post, comb)
    assert got.dtype == dtype and _rel(got, ref.hc_expand(out, h, post, comb)) <= tol


def test_dispatch_binds_v41_ops():
    """'ref' binds the references, 'fused' the kernels, 'auto' on CPU tensors runs the references."""
    try:
        kernels.set_backend("ref")
        assert kernels.v41_hc_site_collapse is ref.hc_site_collapse
        kernels.set_backend("fused")
        assert kernels.v41_hc_site_collapse is fused.FUSED["v41_hc_site_collapse"]
    finally:
        kernels.set_backend("auto")
    h, pre = torch.randn(2, 4, 8, dtype=torch.float64), torch.rand(2, 4, dtype=torch.float64)
    fn, base, scale = torch.randn(24, 32, dtype=torch.float64), torch.zeros(24), torch.ones(3)
    got = kernels.v41_hc_site_collapse(h, pre, fn, base, scale, 1e-6, 1e-6, 3)
    for g, w in zip(got, ref.hc_site_collapse(h, pre, fn, base, scale, 1e-6, 1e-6, 3)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("rows, dim", [(1, 7), (5, 64), (3, 300)])
def test_rms_norm_casts_before_the_weight(rows, dim):
    """V4.1's order (row rounded to x's dtype, then the weight): fp32 to fp32 rounding, bf16 within BF16."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, BF16)):
        x, w = torch.randn(rows, 2, dim).to(dtype), (torch.rand(dim) + 0.5).to(dtype)
        got, want = fused.FUSED["v41_rms_norm"](x, w, 1e-6), ref.rms_norm(x, w, 1e-6)
        assert got.dtype == want.dtype and got.shape == want.shape and _rel(got, want) <= tol
    x, w = torch.randn(3, 40).to(torch.bfloat16), torch.rand(40) + 0.5  # fp32 weight: promoted, as torch does
    assert fused.FUSED["v41_rms_norm"](x, w, 1e-6).dtype == ref.rms_norm(x, w, 1e-6).dtype == torch.float32


@pytest.mark.parametrize("shape", [(1, 64), (3, 4, 72), (2, 3, 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference(shape, inverse):
    """Interleaved pairs on the trailing 2 * cos.shape[-1] channels, the rest untouched; inverse undoes it."""
    torch.manual_seed(len(shape))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, BF16)):
        x = torch.randn(shape).to(dtype)
        ang = torch.rand(shape[0], 8) * 6
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        got, want = fused.FUSED["v41_rope"](x, cos, sin, inverse), ref.rope(x, cos, sin, inverse)
        assert got.dtype == dtype and _rel(got, want) <= tol
        assert torch.equal(got[..., :-16], x[..., :-16])
    x, cos, sin = x.float(), ang.cos(), ang.sin()
    back = fused.FUSED["v41_rope"](fused.FUSED["v41_rope"](x, cos, sin), cos, sin, True)
    assert _rel(back, x) <= 1e-5


def _kv_like(shape, dtype):
    """Rows of mixed magnitudes (one block near zero, one large) and exact ties on the grids."""
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-1] // 16).repeat_interleave(16)
    x[..., :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0, 0, 0, 0, 0, 6.0])
    x[..., 16:32] *= 1e-7
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(1, 64), (3, 4, 128), (5, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_fp8_matches_reference(shape, dtype):
    """e4m3 with a ue8m0 scale per 32: every value on the reference's grid point (ties to even), so
    bit for bit in fp32; bf16 within one of the interpreter's truncated bf16 steps."""
    x = _kv_like(shape, dtype)
    got, want = fused.FUSED["v41_fake_quant_fp8"](x, 32), ref.fake_quant_fp8(x, 32)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()


@pytest.mark.parametrize("shape, block, e4m3", [((1, 64), 32, False), ((3, 4, 128), 32, False), ((5, 512), 16, True),
                                               ((2, 48), 16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_fp4_matches_reference(shape, block, e4m3, dtype):
    """e2m1 per block with ue8m0 (indexer) or e4m3 (compressed KV) scales: fp32 bit for bit (the
    grid's ties included); bf16 within one of the interpreter's truncated bf16 steps. A last dim not a
    block multiple passes through, as the reference."""
    x = _kv_like(shape, dtype)
    got, want = fused.FUSED["v41_fake_quant_fp4"](x, block, e4m3), ref.fake_quant_fp4(x, block, e4m3)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
    odd = torch.randn(3, 40)
    assert fused.FUSED["v41_fake_quant_fp4"](odd, 32) is odd


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("T, E, k, D, temp", [(1, 8, 6, 64, 1.0), (5, 384, 6, 96, 1.0), (3, 30, 2, 40, 0.7)])
def test_router_matches_reference(scoring, T, E, k, D, temp):
    """The same experts (as sets: the MoE sums over them) with the same fp32 weights, bf16 input; no
    renormalisation (V4's kernel always renormalises) falls back to the reference."""
    torch.manual_seed(E)
    x, w = torch.randn(T, D).to(torch.bfloat16), (torch.randn(E, D) * 0.2).to(torch.bfloat16)
    bias = torch.randn(E) * 0.1
    got_w, got_i = fused.FUSED["v41_router"](x, w, bias, k, 2.5, scoring, temp, True)
    want_w, want_i = ref.router(x, w, bias, k, 2.5, scoring, temp, True)
    assert got_w.dtype == torch.float32 and got_i.dtype == want_i.dtype
    order_g, order_w = got_i.sort(-1), want_i.sort(-1)
    assert torch.equal(order_g.values, order_w.values)
    assert (got_w.gather(1, order_g.indices) - want_w.gather(1, order_w.indices)).abs().max() <= 1e-5
    no_renorm = fused.FUSED["v41_router"](x, w, bias, k, 2.5, scoring, temp, False)
    for g, want in zip(no_renorm, ref.router(x, w, bias, k, 2.5, scoring, temp, False)):
        assert torch.equal(g, want)
    span = (E // 4, E // 2)  # expert parallelism's rank: its experts' ids counted from span[0], -1 for the others
    for renorm in (True, False):
        sw, si = fused.FUSED["v41_router"](x, w, bias, k, 2.5, scoring, temp, renorm, span)
        aw, ai = fused.FUSED["v41_router"](x, w, bias, k, 2.5, scoring, temp, renorm)
        assert torch.equal(sw, aw) and torch.equal(si, local_experts(ai, span))
        assert torch.equal(ref.router(x, w, bias, k, 2.5, scoring, temp, renorm, span)[1],
                           local_experts(ref.router(x, w, bias, k, 2.5, scoring, temp, renorm)[1], span))


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_matches_reference(limit, dtype):
    """fp32 out from either input dtype, clamps where limit > 0 (values reach past it here)."""
    gate, up = (torch.randn(3, 1500) * 8).to(dtype), (torch.randn(3, 1500) * 8).to(dtype)
    got, want = fused.FUSED["v41_clamped_swiglu"](gate, up, limit), ref.clamped_swiglu(gate, up, limit)
    assert got.dtype == want.dtype == torch.float32
    assert _rel(got, want) <= 1e-6


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_clamped_swiglu_rounds_once_to_out_dtype(out_dtype):
    gate, up = (torch.randn(2, 700) * 8).to(torch.bfloat16), (torch.randn(2, 700) * 8).to(torch.bfloat16)
    got, want = (fused.FUSED["v41_clamped_swiglu"](gate, up, 10.0, out_dtype),
                 ref.clamped_swiglu(gate, up, 10.0, out_dtype))
    assert got.dtype == want.dtype == (out_dtype or torch.float32)
    assert _rel(got, want) <= (BF16 if out_dtype else 1e-6)


@pytest.mark.parametrize("a_dtype, dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                            (torch.float32, torch.float32)])
def test_moe_sum_adds_in_fp32(a_dtype, dtype):
    """routed (the fused MoE's x dtype, or the CPU loop's fp32) + shared, one rounding to dtype."""
    a, b = torch.randn(3, 333).to(a_dtype), torch.randn(3, 333).to(torch.bfloat16)
    got, want = fused.FUSED["v41_moe_sum"](a, b, dtype), ref.moe_sum(a, b, dtype)
    assert got.dtype == want.dtype == dtype
    assert _rel(got, want) <= (BF16 if dtype == torch.bfloat16 else 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_swiglu_matches_reference(dtype):
    """V4's shared expert through V4.1's kernel: the input dtype out, clamped (values reach past the
    limit); bf16 within two roundings of the reference (it rounds after silu, the clamp and the product)."""
    gate, up = (torch.randn(3, 1500) * 8).to(dtype), (torch.randn(3, 1500) * 8).to(dtype)
    got, want = fused.FUSED["swiglu"](gate, up, 10.0), ref_v4.swiglu(gate, up, 10.0)
    assert got.dtype == want.dtype == dtype
    assert _rel(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("T, D", [(1, 64), (3, 1500)])  # the last: two passes of 1024 columns
def test_engram_gate_matches_reference(T, D):
    """Gates near 0, 1/2 and 1 (matches of both signs; a zero key: the signed sqrt's clamp), fp32
    within 1e-5 and bf16 within BF16 of the scale."""
    torch.manual_seed(D)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, BF16)):
        h = torch.randn(T, 4, D)
        key = torch.randn(T, 4, D)
        key[:, 0] = h[:, 0] * 3  # a strong positive match
        key[:, 1] = -h[:, 1]  # a strong negative one
        key[:, 2] = 0.0  # no match: the gate is sigmoid(sqrt(1e-6))
        kv = torch.cat([key.flatten(1), torch.randn(T, D)], dim=-1).to(dtype)
        h = h.to(dtype)
        qw, kw = (torch.rand(4, D) + 0.5).to(dtype), (torch.rand(4, D) + 0.5).to(dtype)
        got, want = fused.FUSED["v41_engram_gate"](h, kv, qw, kw, 1e-6), ref.engram_gate(h, kv, qw, kw, 1e-6)
        assert got.dtype == dtype and _rel(got, want) <= tol, _rel(got, want)
