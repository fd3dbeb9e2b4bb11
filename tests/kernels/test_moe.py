"""Fused MoE grouped GEMMs vs the reference: awkward sizes, one token, experts with no tokens,
and a prefill large enough for the large row tiles."""

import pytest
import torch

from kernels import fused_moe, quant_configs
from kernels import reference as ref
from kernels.fused_moe import align_by_expert, moe_experts_fused


@pytest.mark.parametrize("T, D, I, E, k", [(1, 32, 16, 4, 2), (19, 40, 24, 8, 3), (5, 64, 72, 16, 6),
                                        (30, 32, 24, 4, 4), (700, 32, 24, 8, 6)])  # 64-row tiles: decode, prefill
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


def test_alignment_pads_each_expert_to_whole_blocks():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, experts, max_blocks = align_by_expert(idx, num_experts=5, block_m=4)
    blocks = sorted_ids.view(max_blocks, 4)
    seen = {}
    for b, e in enumerate(experts.tolist()):
        if e >= 0:
            pairs = [p for p in blocks[b].tolist() if p < 6]
            assert all(idx.view(-1)[p] == e for p in pairs)
            seen.setdefault(e, []).extend(pairs)
    assert sorted(p for ps in seen.values() for p in ps) == list(range(6))
    assert set(seen) == {0, 1, 3}


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
@pytest.mark.parametrize("mx_scaled", [False, True])
def test_moe_experts_quantized(fmt, T, D, I, E, k, path, mx_scaled, monkeypatch):
    """Stored FP8 (128x128 float32 scales) and MXFP4 (1x32 ue8m0) experts, dequantized in registers,
    vs the reference that dequantizes then multiplies. bf16: both sides multiply the same bf16
    values (dequantized e4m3 / e2m1 times a power of two is exact in bf16), so the bound is the
    bf16 rounding of h between the two GEMMs and accumulation order. Both kernel paths: the
    decode one (no sort) and the sorted one prefill takes. mx_scaled: MXFP4 through tl.dot_scaled
    (the GPU's default; here the interpreter's), else the e4m3 bit placement."""
    if mx_scaled and fmt != "mxfp4":
        pytest.skip("tl.dot_scaled serves MXFP4 only")
    monkeypatch.setattr(fused_moe, "MX_SCALED_OK", mx_scaled)
    if path == "sorted":
        monkeypatch.setattr(quant_configs, "MOE_DECODE_MAX_PAIRS", 0)
    g = torch.Generator().manual_seed(T * E + D)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w1, s1 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, fmt)
    w3, s3 = _stored_experts(torch.randn(E, I, D, generator=g) / D**0.5, fmt)
    w2, s2 = _stored_experts(torch.randn(E, D, I, generator=g) / I**0.5, fmt)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    scales = (s1, s3, s2)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * max(want.abs().max().item(), 1.0)
    hit = torch.zeros(E, dtype=torch.bool)
    hit[idx.reshape(-1)] = True
    assert hit.all() == (k == E or T >= 9), "the shapes cover both some empty experts and all experts hit"
