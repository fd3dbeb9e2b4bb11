"""Fused RMSNorm, mHC and router kernels against their torch references (TRITON_INTERPRET=1 on CPU).
Awkward sizes, one-token batches, output buffers poisoned by torch.empty; tolerances stated."""

import pytest
import torch

from kernels import reference as ref
from kernels.fused_gate import router_topk_fused
from kernels.fused_norm_mhc import (
    hc_post_fused,
    hc_post_pre_norm_fused,
    hc_pre_fused,
    rms_norm_fused,
    rms_norm_unweighted_fused,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    scale = max(b.abs().max().item(), 1.0)
    assert (a.float() - b.float()).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 7), (5, 64), (3, 300)])
def test_rms_norm(dtype, rows, dim):
    x = torch.randn(rows, dim).to(dtype)
    w = torch.rand(dim) + 0.5
    _close(rms_norm_fused(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    _close(rms_norm_unweighted_fused(x.view(rows, 1, dim), 1e-6), ref.rms_norm_unweighted(x.view(rows, 1, dim), 1e-6), dtype)


@pytest.mark.parametrize("T, D", [(1, 24), (17, 40), (33, 8), (3, 2100),  # many K splits
                                  (300, 520)])  # the prefill tiles (fused_norm_mhc.MIX_WIDE_T), a partial last tile
def test_hc_pre_matches_reference(T, D):
    torch.manual_seed(T)
    x = torch.randn(T, 4, D)
    fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    got = hc_pre_fused(x, fn, base, scale, 1e-6, 1e-6, 20)
    want = ref.hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * max(w.abs().max(), 1), (g - w).abs().max()
    comb = got[1]
    assert torch.allclose(comb.sum(-2), torch.ones(T, 4), atol=1e-4)  # doubly stochastic columns


@pytest.mark.parametrize("T, D", [(1, 24), (17, 40),  # decode's tiles: one token, several token tiles
                                  (300, 520)])  # the prefill tiles, a partial last tile
def test_mix_bf16x3_partials_are_fp32_exact_and_equal_the_tf32x3_kernel(T, D):
    """mix_bf16x3 (kernels/variants.py): fn's three bf16 pieces sum back to fn exactly; the partials of bf16
    streams equal the fp64 products to fp32 precision, and today's kernel's partials, and hc_pre's outputs
    equal the reference as today's do. (The interpreter runs the pieces' dots in fp32 "ieee": the same exact
    products; the GPU's bf16 dots: suite prefill_small_ops.)"""
    from kernels import fused_norm_mhc, variants

    torch.manual_seed(T + D)
    x = torch.randn(T, 4, D).bfloat16()
    fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    pieces = fused_norm_mhc.mix_pieces(fn)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, 24, 4 * D)
    assert torch.equal(pieces.float().sum(0), fn) and not torch.equal(pieces[0].float(), fn)
    flat = x.double().reshape(T, -1)
    exact = torch.cat([flat @ fn.double().T, (flat * flat).sum(-1, keepdim=True)], -1)
    today = fused_norm_mhc._hc_mix_partials(x, fn).sum(0)[:, :25].double()
    try:
        variants.set_variants("mix_bf16x3")
        new = fused_norm_mhc._hc_mix_partials(x, fn).sum(0)[:, :25].double()
        got = hc_pre_fused(x, fn, base, scale, 1e-6, 1e-6, 20)
    finally:
        variants.set_variants(variants.DEFAULT)
    # fp32 precision of a K-term sum: within K * 2^-24 of the sum of the terms' magnitudes (the worst-case bound;
    # the summation order, which the interpreter's BLAS picks per machine, moves results inside it, not past it)
    K = 4 * D
    bound = K * 2.0**-24 * torch.cat([flat.abs() @ fn.double().abs().T, (flat * flat).sum(-1, keepdim=True)], -1)
    assert ((new - exact).abs() <= bound).all() and ((new - today).abs() <= 2 * bound).all()
    for g, w in zip(got, ref.hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)):
        _close(g, w, x.dtype if g.dtype == x.dtype else torch.float32)


def test_mix_pieces_split_once_per_weight_and_again_when_it_changes():
    """The pieces are cached by the weight tensor (it does not change between steps), refreshed when it is written
    in place; streams that are not bf16 take today's kernel with the variant on."""
    from kernels import fused_norm_mhc, variants

    fn = torch.randn(24, 64) * 0.1
    first = fused_norm_mhc.mix_pieces(fn)
    assert fused_norm_mhc.mix_pieces(fn) is first
    fn.mul_(2)
    assert torch.equal(fused_norm_mhc.mix_pieces(fn).float().sum(0), fn)
    x = torch.randn(3, 4, 16)
    want = fused_norm_mhc._hc_mix_partials(x, fn)[..., :25]  # the rest of each row is never written
    try:
        variants.set_variants("mix_bf16x3")
        assert torch.equal(fused_norm_mhc._hc_mix_partials(x, fn)[..., :25], want)
    finally:
        variants.set_variants(variants.DEFAULT)
    with pytest.raises(ValueError, match="unknown kernel variants"):
        variants.set_variants("rope_tiles,mix_fp64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(dtype):
    T, D = 9, 50
    x, out = torch.randn(T, 4, D).to(dtype), torch.randn(T, D).to(dtype)
    post, comb = torch.rand(T, 4) * 2, torch.rand(T, 4, 4)
    _close(hc_post_fused(x, out, post, comb), ref.hc_post(x, out, post, comb), dtype)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("T, E, k, D", [(1, 8, 2, 32), (13, 256, 6, 300), (4, 30, 3, 64), (40, 24, 6, 520)])
@pytest.mark.parametrize("hashed", [False, True])
def test_router_topk(scoring, T, E, k, D, hashed):
    """Mega-Gate (GEMM + scores + bias + top-k + renormalise, the last E tile of each 16-token tile
    selecting) vs the reference: the same experts, weights within float32 rounding; hash layers
    (tid2eid's experts) gather and renormalise their scores. Shapes: D off and over the K step,
    E off the 16-row tile, several token tiles."""
    from kernels.semaphores import all_zero

    torch.manual_seed(E + k + D)
    x, w, bias = torch.randn(T, D), torch.randn(E, D) / D**0.5, torch.randn(E) * 0.1
    hash_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if hashed else None
    gw, gi = router_topk_fused(x, w, None if hashed else bias, k, 1.5, scoring, hash_ids)
    rw, ri = ref.router_topk(x, w, None if hashed else bias, k, 1.5, scoring, hash_ids)
    order_g, order_r = gi.sort(-1), ri.sort(-1)
    assert torch.equal(order_g.values, order_r.values)
    assert torch.allclose(gw.gather(1, order_g.indices), rw.gather(1, order_r.indices), atol=1e-5)
    assert torch.allclose(gw.sum(-1), torch.full((T,), 1.5), atol=1e-5)
    assert all_zero(), "the per-tile counters are left zero for the next call"


@pytest.mark.parametrize("T, D", [(1, 40), (17, 64), (3, 200)])  # off the 64-column split; several token tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_norm_matches_reference(T, D, dtype):
    """Mega-mHC (hc_post + the next hc_pre + RMSNorm, the norm's sum of squares from the streams' Gram
    matrix) vs the three references in a row; bf16: the references round the collapsed row before
    the norm, the kernel does not, so within bf16 rounding."""
    torch.manual_seed(T * D)
    h, out = torch.randn(T, 4, D).to(dtype), torch.randn(T, D).to(dtype)
    post, comb = torch.rand(T, 4) * 2, torch.rand(T, 4, 4)
    fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    norm_w = torch.rand(D) + 0.5
    args = (h, out, post, comb, fn, base, scale, norm_w, 1e-6, 1e-6, 1e-6, 20)
    got = hc_post_pre_norm_fused(*args)
    want = ref.hc_post_pre_norm(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        _close(g, w, dtype)


@pytest.mark.parametrize("T, D", [(3, 600), (17, 72)])  # several finish column blocks; several token tiles
def test_mega_mhc_in_one_launch_equals_the_two_launches(T, D):
    """mega_mhc_one: each token tile's last split runs the finish (Sinkhorn, collapse, RMSNorm) in the finish
    kernel's tiles: bit for bit the two launches' four outputs, and the tile counters are left zero."""
    from kernels.semaphores import all_zero

    torch.manual_seed(T + D)
    h, out = torch.randn(T, 4, D).bfloat16(), torch.randn(T, D).bfloat16()
    post, comb = torch.rand(T, 4) * 2, torch.rand(T, 4, 4)
    fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    args = (h, out, post, comb, fn, base, scale, torch.rand(D) + 0.5, 1e-6, 1e-6, 1e-6, 20)
    got = hc_post_pre_norm_fused(*args, one_launch=True)
    assert all_zero()
    for g, w in zip(got, hc_post_pre_norm_fused(*args)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("mega", [False, True])
@pytest.mark.parametrize("hashed", [False, True])
def test_routers_give_one_ranks_local_ids_and_x_dtype_weights_from_the_routing_launch(mega, hashed):
    """expert_span (lo, hi), expert parallelism's rank: the ids of experts in [lo, hi) counted from lo and -1 for the
    others (kernels.reference.local_experts of the ids without it), the weights unchanged; bf16 activations get
    bf16 weights (the route's float32 weights rounded in the launch), the reference's within bf16. With the
    alignment (every gate row) a span is refused."""
    from kernels.fused_gate import router_topk_fused, router_topk_gemm_fused

    router = router_topk_fused if mega else router_topk_gemm_fused
    torch.manual_seed(11)
    T, E, k, D, span = 9, 32, 6, 64, (8, 16)
    x, w, bias = torch.randn(T, D).bfloat16(), (torch.randn(E, D) / D**0.5).bfloat16(), torch.randn(E) * 0.1
    hash_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if hashed else None
    gate = (w, None if hashed else bias, k, 1.5, "sqrtsoftplus", hash_ids)
    w_all, i_all = router(x, *gate)
    w_span, i_span = router(x, *gate, expert_span=span)
    assert w_all.dtype == torch.bfloat16 and torch.equal(w_span, w_all)
    assert torch.equal(i_span, ref.local_experts(i_all, span))
    assert (i_span == -1).any() and ((i_span >= 0) & (i_span < span[1] - span[0])).any()
    rw, ri = ref.router_topk(x, *gate, expert_span=span)
    r_all = ref.router_topk(x, *gate)[1]
    assert torch.equal(ri, ref.local_experts(r_all, span))
    order_g, order_r = i_all.sort(-1), r_all.sort(-1)  # global ids: no ties to order
    assert torch.equal(order_g.values, order_r.values)
    assert torch.allclose(w_span.float().gather(1, order_g.indices), rw.float().gather(1, order_r.indices),
                          atol=1e-2)
    if not hashed:
        with pytest.raises(ValueError, match="expert_span"):
            router(x, *gate, align_m=16, expert_span=span)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("hashed", [False, True])
def test_engine_router_and_composed_mhc_match_the_references(T, hashed):
    """What kernels.fused dispatches on CUDA: the router as GEMM + one program per token, and Mega-mHC
    as the three fused ops, against the references."""
    from kernels.fused import hc_post_pre_norm_composed
    from kernels.fused_gate import router_topk_gemm_fused

    torch.manual_seed(T)
    E, k, D = 40, 6, 64
    x, w, bias = torch.randn(T, D), torch.randn(E, D) / D**0.5, torch.randn(E) * 0.1
    hash_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if hashed else None
    gw, gi = router_topk_gemm_fused(x, w, None if hashed else bias, k, 1.5, "sqrtsoftplus", hash_ids)
    rw, ri = ref.router_topk(x, w, None if hashed else bias, k, 1.5, "sqrtsoftplus", hash_ids)
    order_g, order_r = gi.sort(-1), ri.sort(-1)
    assert torch.equal(order_g.values, order_r.values)
    assert torch.allclose(gw.gather(1, order_g.indices), rw.gather(1, order_r.indices), atol=1e-5)
    h, out = torch.randn(T, 4, D), torch.randn(T, D)
    post, comb = torch.rand(T, 4) * 2, torch.rand(T, 4, 4)
    fn, base, scale = torch.randn(24, 4 * D) * 0.1, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    args = (h, out, post, comb, fn, base, scale, torch.rand(D) + 0.5, 1e-6, 1e-6, 1e-6, 20)
    for g, want in zip(hc_post_pre_norm_composed(*args), ref.hc_post_pre_norm(*args)):
        _close(g, want, torch.float32)


def test_router_gate_through_the_bf16_gemv_where_the_variant_takes_it(monkeypatch):
    """Kernel variant bf16_gemv on the router's gate (on the GPU at decode's rows; forced here, where it never takes
    a CPU tensor): the GEMV computes the logits and the router picks the reference's experts and weights. Logits
    exact in bf16 (multiples of 2^-4) leave no near-tie for a rounding to flip."""
    import kernels.fused_gate as fg

    calls, real = [], fg.bf16_gemv

    def gemv(x, w):
        calls.append(tuple(w.shape))
        return real(x, w)

    monkeypatch.setattr(fg, "bf16_gemv_takes", lambda x, w: True)
    monkeypatch.setattr(fg, "bf16_gemv", gemv)
    T, E, k, D = 3, 24, 6, 64
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-2, 3, (T, D), generator=g).to(torch.bfloat16)
    w = (torch.randint(-4, 5, (E, D), generator=g) / 16).to(torch.bfloat16)
    bias = (torch.randint(-4, 5, (E,), generator=g) / 64).float()
    gw, gi = fg.router_topk_gemm_fused(x, w, bias, k, 1.5, "sqrtsoftplus")
    rw, ri = ref.router_topk(x, w, bias, k, 1.5, "sqrtsoftplus")
    assert calls == [(E, D)]
    order_g, order_r = gi.sort(-1), ri.sort(-1)
    assert torch.equal(order_g.values, order_r.values)
    assert torch.allclose(gw.float().gather(1, order_g.indices), rw.float().gather(1, order_r.indices), atol=1e-2)
