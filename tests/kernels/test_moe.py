"""Fused MoE grouped GEMMs and their row alignment vs the references: awkward sizes, one token,
experts with no tokens, every decode row tile (16 to 128 rows, chosen from the rows per expert)
and a prefill large enough for the prefill tiles."""

import pytest
import torch

from kernels import fused_moe, quant_configs
from kernels import reference as ref
from kernels.fused_moe import moe_experts_fused
from kernels.fused_moe_align import moe_align_fused


@pytest.mark.parametrize("T, D, I, E, k", [(1, 32, 16, 4, 2), (19, 40, 24, 8, 3), (5, 64, 72, 16, 6),
                                        (30, 32, 24, 4, 4), (150, 32, 24, 16, 6),  # decode: 16 / 32 / 128-row tiles
                                        (200, 32, 24, 8, 6)])  # prefill: 1,200 pairs, past MOE_DECODE_MAX_PAIRS
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_experts(T, D, I, E, k, dtype, tol):
    g = torch.Generator().manual_seed(T * E)
    x = torch.randn(T, D, generator=g).to(dtype)
    w1, w3 = (torch.randn(E, I, D, generator=g) / D**0.5).to(dtype), (torch.randn(E, I, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(dtype)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0)
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0)
    assert (got.float() - want.float()).abs().max() <= tol * max(want.abs().max().item(), 1.0)


@pytest.mark.parametrize("T, path", [(3, "decode"), (40, "decode"), (40, "sorted")])
def test_skipped_pairs_add_nothing(T, path, monkeypatch):
    """Expert parallel: pairs routed to another rank's expert come as index -1 and add nothing;
    the rest equal the reference on the full expert set with those pairs' weights zeroed."""
    if path == "sorted":
        monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    E, D, I, k = 8, 32, 24, 3
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g)
    w1, w3 = torch.randn(E, I, D, generator=g) / D**0.5, torch.randn(E, I, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, I, generator=g) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    lo, hi = 2, 6  # this rank's experts
    local = (idx >= lo) & (idx < hi)
    want = ref.moe_experts(x, w1, w3, w2, torch.where(local, w, 0), idx, 10.0)
    local_idx = torch.where(local, idx - lo, -1)
    for fn in (ref.moe_experts, moe_experts_fused):
        got = fn(x, w1[lo:hi], w3[lo:hi], w2[lo:hi], w, local_idx, 10.0)
        assert (got - want).abs().max() <= 1e-5 * max(want.abs().max().item(), 1.0), fn.__name__


@pytest.mark.parametrize("T, E, k, block_m", [(1, 8, 2, 16), (3, 5, 2, 4), (150, 16, 6, 128), (40, 256, 6, 16),
                                             (3000, 16, 6, 64)])  # the last: several chunks of the kernel's loops
@pytest.mark.parametrize("skipped", [False, True])
def test_alignment_matches_reference(T, E, k, block_m, skipped):
    """Every pair in exactly one tile of its own expert, tiles of at most block_m rows, unused tiles -1,
    the same tiles as the torch reference (the kernel may order pairs within an expert differently);
    skipped: a third of the pairs are another rank's (-1) and in no tile."""
    g = torch.Generator().manual_seed(T + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if skipped:
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.33, -1, idx)
    got, want = moe_align_fused(idx, E, block_m), ref.moe_align(idx, E, block_m)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)
    sorted_ids, end, experts, start = got
    flat, seen = idx.reshape(-1), []
    for e, s in zip(experts.tolist(), start.tolist()):
        if e < 0:
            continue
        pairs = sorted_ids[s:min(s + block_m, int(end[e]))].tolist()
        assert pairs and all(int(flat[p]) == e for p in pairs)
        seen += pairs
    assert sorted(seen) == (flat >= 0).nonzero().flatten().tolist()
    assert (experts >= 0).sum() == sum(-(-int(c) // block_m) for c in torch.bincount(flat[flat >= 0], minlength=E))


def test_decode_tiles_fit_each_experts_rows():
    """Each expert's rows in one tile at the decode shapes of V4-Flash depth (16 experts, top-6) up to
    32 rows; past that the format's largest tile measured faster (MXFP4 64 rows, FP8 128, bf16 32)."""
    assert quant_configs.moe_block_m(1, 6, 16) == 16
    assert quant_configs.moe_block_m(32, 192, 16) == 32
    assert quant_configs.moe_block_m(150, 900, 16) == 64
    assert quant_configs.moe_block_m(150, 900, 16, "fp8") == 128
    assert quant_configs.moe_block_m(150, 900, 16, "dense") == 32
    assert quant_configs.moe_block_m(150, 900, 256) == 16


def _stored_experts(w, fmt):
    """[E, N, K] weights in a stored format -> (weights, scales as the loader hands them)."""
    from kernels.formats import quantize_fp8_block, quantize_mxfp4, scale_to_float

    if fmt == "fp8":
        q, s = quantize_fp8_block(w, ue8m0=False)  # Base: float32 block scales
        return q, scale_to_float(s)
    q, s = quantize_mxfp4(w)
    return q, s.view(torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T, D, I, E, k", [
    (1, 64, 32, 8, 2),      # one token: most experts have zero rows
    (9, 128, 160, 4, 4),    # every expert hit; D at the 128 block, I off it
    (5, 96, 256, 16, 3),    # D off the block, I two blocks; most experts empty
    (70, 256, 64, 6, 6),    # all experts hit by every token
])
@pytest.mark.parametrize("path", ["decode", "sorted"])
@pytest.mark.parametrize("mx", ["e4m3", "scaled", "bf16", "bf16-parts", "bf16-frag"])
def test_moe_experts_quantized(fmt, T, D, I, E, k, path, mx, monkeypatch):
    """Stored FP8 (128x128 float32 scales) and MXFP4 (1x32 ue8m0) experts, dequantized in registers,
    vs the reference that dequantizes then multiplies. bf16: both sides multiply the same bf16
    values (dequantized e4m3 / e2m1 times a power of two is exact in bf16), so the bound is the
    bf16 rounding of h between the two GEMMs and accumulation order. Both tile tables: decode
    (BLOCK_M from the rows per expert) and prefill. mx: the MXFP4 decode: the e4m3 bit placement,
    tl.dot_scaled (here the interpreter's) or the integer bf16 decode (here its Triton twin of the PTX)."""
    if mx != "e4m3" and fmt != "mxfp4":
        pytest.skip("the MX decodes are MXFP4's")
    if mx != "e4m3" and path == "sorted":
        pytest.skip("the same tile function as the decode tiles: once is enough in the interpreter")
    monkeypatch.setattr(fused_moe, "MX_SCALED_OK", mx == "scaled")
    if path == "sorted":
        monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    cfg = {part: {**c, "MX": mx} for part, c in quant_configs.moe_config(T, T * k, E, fmt).items()}
    g = torch.Generator().manual_seed(T * E + D)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w1, s1 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, fmt)
    w3, s3 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, fmt)
    w2, s2 = _stored_experts(torch.randn(E, D, I, generator=g) / I**0.5, fmt)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    scales = (s1, s3, s2)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, config=cfg)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    hit = torch.zeros(E, dtype=torch.bool)
    hit[idx.reshape(-1)] = True
    assert hit.all() == (k == E or T >= 9), "the shapes cover both some empty experts and all experts hit"


# each stored format's K steps, and "bf16-parts", whose wider BLOCK_K (128) cuts K in other splits; the
# "bf16" decode is another tile function on e4m3's K steps (test_moe_experts_quantized covers it)
@pytest.mark.parametrize("fmt, mx", [("dense", "e4m3"), ("fp8", "e4m3"), ("mxfp4", "e4m3"), ("mxfp4", "bf16-parts"),
                                     ("mxfp4", "bf16-frag"), ("mxfp4", "bf16-frag16")])
def test_moe_experts_split_k(fmt, mx):
    """Split-K (the decode's few-row steps): K cut unevenly (5 K steps in 3 splits, the last one
    short), the last split of each tile adds the partials in split order and applies the epilogue
    (SwiGLU, routing weight); the counters are left zero for the next call and for CUDA graphs."""
    from kernels import semaphores

    T, D, I, E, k = 3, 320, 192, 8, 2  # the interpreter's BLOCK_K 64: 5 K steps for gate_up, 3 for down
    if mx.startswith("bf16-frag"):  # its 128-wide K steps: 3 for gate_up (one a split), 2 for down
        D, I = 384, 256
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    raw = [torch.randn(E, I, D, generator=g) / D**0.5, torch.randn(E, I, D, generator=g) / D**0.5,
           torch.randn(E, D, I, generator=g) / I**0.5]
    if fmt == "dense":
        (w1, w3, w2), scales = (r.to(torch.bfloat16) for r in raw), None
    else:
        (w1, s1), (w3, s3), (w2, s2) = (_stored_experts(r, fmt) for r in raw)
        scales = (s1, s3, s2)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    cfg = {part: {**c, "MX": mx, "SPLIT_K": 3} for part, c in quant_configs.moe_config(T, T * k, E, fmt).items()}
    stored = [fused_moe.arrange_lane_major(v) for v in (w1, w3, w2)] if mx == "bf16-frag16" else (w1, w3, w2)
    got = moe_experts_fused(x, *stored, w, idx, 10.0, scales, config=cfg)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    assert semaphores.all_zero()
    assert quant_configs.moe_split_k({}, 192, 32) == 4 and quant_configs.moe_split_k({}, 4096, 32) == 1


def test_lane_major_puts_word_l_of_group_g_at_4l_plus_g():
    """to_lane_major reorders whole 32-bit words within each 128-value step (nibbles keep their places in a word):
    stored word 4 g + l (lane l's word of group g) moves to 4 l + g, so a lane's four words are contiguous."""
    from kernels.fused_dequant import to_lane_major

    words = torch.arange(2 * 2 * 16, dtype=torch.int32).reshape(2, 32)  # 2 rows x 2 steps of 16 words
    moved = to_lane_major(words.view(torch.int8)).view(torch.int32)
    g, l = torch.arange(4).repeat_interleave(4), torch.arange(4).repeat(4)  # stored word i = 4 g + l
    for step in range(2):
        assert torch.equal(moved[:, 16 * step + 4 * l + g], words[:, 16 * step + 4 * g + l])
    with pytest.raises(ValueError, match="whole 128-value K steps"):
        to_lane_major(torch.zeros(2, 48, dtype=torch.int8))  # K = 96


@pytest.mark.parametrize("T, E, k, one_mul", [(1, 8, 2, False), (5, 4, 3, True), (40, 6, 6, False)])
def test_frag16_decode_of_lane_major_weights_is_the_reference(T, E, k, one_mul):
    """"bf16-frag16": the MMA-operand decode reading weights arranged lane-major at load (one 16-byte load a row a
    step), at the 16-, 32- and 64-row tiles, against the reference on the weights as stored."""
    D, I = 256, 128  # whole 128-value K steps for both parts
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, s1), (w3, s3), (w2, s2) = (_stored_experts(torch.randn(E, n, kk, generator=g) / kk**0.5, "mxfp4")
                                    for n, kk in ((I, D), (I, D), (D, I)))
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, (s1, s3, s2))
    mode = "bf16-frag16-one-mul" if one_mul else "bf16-frag16"
    cfg = {part: {**c, "MX": mode} for part, c in quant_configs.moe_config(T, T * k, E, "mxfp4").items()}
    lanes = [fused_moe.arrange_lane_major(v) for v in (w1, w3, w2)]
    got = moe_experts_fused(x, *lanes, w, idx, 10.0, (s1, s3, s2), config=cfg)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    assert not torch.equal(lanes[0], w1)  # the arrangement moved words: a decode of the stored order would be wrong


def test_lane_major_weights_and_the_frag16_config_go_together():
    """Nothing but "bf16-frag16" reads lane-major weights, and it reads nothing else: either one without the other,
    or a shape it cannot take, is a clear error rather than a silently wrong product."""
    g = torch.Generator().manual_seed(3)
    E, D, I, T, k = 4, 256, 128, 2, 2
    (w1, s1), (w3, s3), (w2, s2) = (_stored_experts(torch.randn(E, n, kk, generator=g) / kk**0.5, "mxfp4")
                                    for n, kk in ((I, D), (I, D), (D, I)))
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    idx, w = torch.tensor([[0, 1], [2, 3]]), torch.ones(T, k, dtype=torch.bfloat16)
    lanes = [fused_moe.arrange_lane_major(v) for v in (w1, w3, w2)]
    frag16 = {part: {**c, "MX": "bf16-frag16"} for part, c in quant_configs.moe_config(T, T * k, E, "mxfp4").items()}
    for args, cfg in (((w1, w3, w2), frag16), ((*lanes,), None), ((*lanes[:2], w2), frag16),
                      ((*lanes,), {**frag16, "down": {**frag16["down"], "MX": "bf16"}})):
        with pytest.raises(ValueError, match="arrange_lane_major"):
            moe_experts_fused(x, *args, w, idx, 10.0, (s1, s3, s2), config=cfg)
    with pytest.raises(ValueError, match="K % 128 == 0"):
        fused_moe._tiles({"BLOCK_N": 32, "BLOCK_K": 64, "MX": "bf16-frag16"}, 2, torch.bfloat16, 192)
    assert fused_moe._tiles({"BLOCK_N": 32, "BLOCK_K": 64, "MX": "bf16-frag16"}, 2, torch.bfloat16, 256)["MX"] == 6


def test_a_register_cap_reaches_the_launch(monkeypatch):
    """A config's "maxnreg" (bench_quant's register-capped decode candidates) is a launch option on the GPU; the
    interpreter takes no launch options."""
    cfg = {**quant_configs.moe_config(1, 6, 16, "mxfp4")["gate_up"], "maxnreg": 96}
    assert fused_moe._opts(cfg) == {}
    monkeypatch.setattr(fused_moe, "_INTERPRET", False)
    assert fused_moe._opts(cfg) == {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "maxnreg": 96}
    assert "maxnreg" not in fused_moe._opts({k: v for k, v in cfg.items() if k != "maxnreg"})


@pytest.mark.parametrize("fused_sum", [True, False])
def test_shared_expert_added_in_the_topk_sum(fused_sum):
    """moe_shared_sum (kernels/fusions.py): the shared expert's output added in the top-k sum's launch
    rounds as `routed + shared` does (equal bits on the GPU; the interpreter's float32 -> bf16 cast is not
    torch's round-to-nearest, so within one bf16 step here), and both equal the reference with `shared`."""
    from kernels import fusions

    T, D, I, E, k = 3, 40, 24, 8, 3
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1, w3 = (torch.randn(E, I, D, generator=g) / D**0.5).bfloat16(), (torch.randn(E, I, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).bfloat16()
    shared = (torch.randn(T, D, generator=g) * 3).bfloat16()
    try:
        fusions.set_fusions("moe_shared_sum" if fused_sum else "")
        got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, None, shared)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    unfused = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0) + shared
    assert ((got.float() - unfused.float()).abs() <= 2**-7 * unfused.float().abs() + 1e-6).all()
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, None, shared)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * want.abs().max().item()
    assert (got.float() - moe_experts_fused(x, w1, w3, w2, w, idx, 10.0).float()).abs().max() > 0.1  # it adds


@pytest.mark.parametrize("T, block_m", [(1, 16), (5, 32)])
def test_router_aligns_the_pairs_in_its_launch(T, block_m):
    """router_topk_gemm_fused's align_m: the router's last program aligns its ids: the same weights and ids as
    without, the same four outputs as the alignment launch on them, the counter left zero."""
    from kernels.fused_gate import router_topk_gemm_fused
    from kernels.semaphores import all_zero

    E, k, D = 40, 6, 64
    g = torch.Generator().manual_seed(T)
    x, w, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) / D**0.5, torch.randn(E, generator=g)
    gw, gi, layout = router_topk_gemm_fused(x, w, bias * 0.1, k, 1.5, "sqrtsoftplus", align_m=block_m)
    assert all_zero()
    want_w, want_i = router_topk_gemm_fused(x, w, bias * 0.1, k, 1.5, "sqrtsoftplus")
    assert torch.equal(gw, want_w) and torch.equal(gi, want_i)
    for got, want in zip(layout, moe_align_fused(gi, E, block_m)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="hash table"):
        router_topk_gemm_fused(x, w, None, k, 1.5, "sqrtsoftplus", align_m=block_m)


@pytest.mark.parametrize("router", ["", "mega_gate"])
def test_router_moe_aligns_in_the_router_only_with_its_switch(monkeypatch, router):
    """kernels.fused.router_moe_fused with align_in_router: no alignment launch (the cuBLAS router's or Mega-Gate's
    does it), the same output as the router then the experts; the reference op (router then experts) within bf16."""
    import kernels.fused_moe_align as align
    from kernels import fusions
    from kernels.fused import router_moe_fused

    T, D, I, E, k = 3, 40, 24, 8, 3
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1, w3 = (torch.randn(E, I, D, generator=g) / D**0.5).bfloat16(), (torch.randn(E, I, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).bfloat16()
    gate_w, gate_b = (torch.randn(E, D, generator=g) / D**0.5).bfloat16(), torch.randn(E, generator=g) * 0.1
    args = (x, gate_w, gate_b, k, 1.5, "sqrtsoftplus", None, w1, w3, w2, 10.0)
    launches = []
    run = align._moe_align_kernel.run
    monkeypatch.setattr(align._moe_align_kernel, "run", lambda *a, **kw: launches.append(1) or run(*a, **kw))
    try:
        fusions.set_fusions(",".join(filter(None, ("align_in_router", router))))
        got = router_moe_fused(*args)
        assert not launches
        fusions.set_fusions(router)
        want = router_moe_fused(*args)
        assert launches
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    assert torch.equal(got, want)
    r = ref.router_moe(*args)
    assert (got.float() - r.float()).abs().max() <= 3e-2 * r.abs().max().item()


@pytest.mark.parametrize("T, hashed", [(1, False), (17, True)])  # two token tiles
def test_mega_gate_aligns_the_pairs_in_its_launch(T, hashed):
    """router_topk_fused's align_m: Mega-Gate's last token tile to be routed aligns every pair: the same weights and
    ids as without, the alignment launch's four outputs on them, the counters left zero."""
    from kernels.fused_gate import router_topk_fused
    from kernels.semaphores import all_zero

    E, k, D = 40, 6, 64
    g = torch.Generator().manual_seed(T)
    x, w, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) / D**0.5, torch.randn(E, generator=g)
    hash_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if hashed else None
    args = (x, w, None if hashed else bias * 0.1, k, 1.5, "sqrtsoftplus", hash_ids)
    gw, gi, layout = router_topk_fused(*args, align_m=16)
    assert all_zero()
    want_w, want_i = router_topk_fused(*args)
    assert torch.equal(gw, want_w) and torch.equal(gi, want_i)
    for got, want in zip(layout, moe_align_fused(gi, E, 16)):
        assert torch.equal(got, want)


def test_the_moe_frag_variant_takes_the_frag_decode(monkeypatch):
    """DSV4_VARIANTS=moe_frag: the tables' integer bf16 decode becomes "bf16-frag" (activations and h in the MMA's K
    order; one multiply a value pair, as these scale bytes allow), the same result as the reference; K off the
    128-wide step (I = 160 here) keeps the bf16 decode."""
    from kernels import variants

    seen = []
    real = fused_moe._tiles
    monkeypatch.setattr(fused_moe, "_tiles", lambda cfg, *a: seen.append(real(cfg, *a)["MX"]) or real(cfg, *a))
    monkeypatch.setattr(variants, "_on", frozenset({"moe_frag"}))
    T, D, I, E, k = 4, 256, 160, 8, 2
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w1, s1 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w3, s3 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w2, s2 = _stored_experts(torch.randn(E, D, I, generator=g) / I**0.5, "mxfp4")
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, (s1, s3, s2))
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, (s1, s3, s2))
    assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    assert seen == [fused_moe.MX_MODES["bf16-frag-one-mul"], fused_moe.MX_MODES["bf16"]]  # down's K: I = 160
    assert fused_moe._tiles({"BLOCK_N": 32, "BLOCK_K": 64, "MX": "bf16-frag"}, 2, torch.bfloat16, 160)["MX"] == 2
    assert fused_moe._tiles({"BLOCK_N": 32, "BLOCK_K": 64, "MX": "bf16-frag"}, 2, torch.bfloat16, 256)["MX"] == 4


def test_moe_frag_takes_one_multiply_only_where_every_scale_byte_allows_it():
    """"bf16-frag-one-mul" is exact only while every ue8m0 byte is <= 128: whoever asks for it (the variant, a table,
    a sweep), a part with one byte past it, or no scales to read, gets two multiplies; the bytes are read once per
    weight and again after an in-place write."""
    cfg, mode = {"BLOCK_N": 32, "BLOCK_K": 64, "MX": "bf16-frag-one-mul"}, fused_moe.MX_MODES
    s = torch.full((4, 8, 2), 127, dtype=torch.uint8)
    t = s.clone()
    assert fused_moe._tiles(cfg, 2, torch.bfloat16, 256, (s, t))["MX"] == mode["bf16-frag-one-mul"]
    t[3, 7, 1] = 129
    assert fused_moe._tiles(cfg, 2, torch.bfloat16, 256, (s, t))["MX"] == mode["bf16-frag"]
    t[3, 7, 1] = 128
    assert fused_moe._tiles(cfg, 2, torch.bfloat16, 256, (t,))["MX"] == mode["bf16-frag-one-mul"]
    s[0, 0, 0] = 200  # written in place after its first read
    assert fused_moe._tiles(cfg, 2, torch.bfloat16, 256, (s,))["MX"] == mode["bf16-frag"]
    assert fused_moe._tiles(cfg, 2, torch.bfloat16, 256)["MX"] == mode["bf16-frag"]


def test_prefill_takes_the_frag_tile_from_its_rows_per_expert(monkeypatch):
    """A prefill-sized MXFP4 call averaging quant_configs.MOE_FRAG_MIN_ROWS rows per expert runs the 128 x 128 tile
    decoding into the MMA's registers (the dispatch's own config, no config passed), as the reference; fewer rows
    keep the table's tile and decode."""
    seen = []
    real = fused_moe._tiles
    monkeypatch.setattr(fused_moe, "_tiles", lambda cfg, *a: seen.append((cfg["BLOCK_M"], real(cfg, *a)["MX"]))
                        or real(cfg, *a))
    monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)  # prefill tiles at the interpreter's sizes
    D, I, E, k = 256, 128, 2, 2
    g = torch.Generator().manual_seed(12)
    w1, s1 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w3, s3 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, "mxfp4")
    w2, s2 = _stored_experts(torch.randn(E, D, I, generator=g) / I**0.5, "mxfp4")
    for T in (quant_configs.MOE_FRAG_MIN_ROWS, quant_configs.MOE_FRAG_MIN_ROWS - 1):  # k = E: T rows per expert
        x = torch.randn(T, D, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g).to(torch.bfloat16)
        want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, (s1, s3, s2))
        got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, (s1, s3, s2))
        assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    frag = fused_moe.MX_MODES["bf16-frag"]
    assert seen[:2] == [(128, frag), (128, frag)] and all(mx != frag for _, mx in seen[2:]), seen
