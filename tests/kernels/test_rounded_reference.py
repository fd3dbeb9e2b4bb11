"""The rounded references (kernels.set_backend("rounded"): float32 arithmetic, bf16 where the kernels store,
e4m3 activations where the FP8 GEMM quantizes) against the fused kernels under the Triton interpreter: far
closer to the kernels on bf16 inputs than the float32 references are, so a teacher-forced comparison against
them is left with kernel error only (tools/check_teacher_forced.py --reference rounded)."""

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.formats import quantize_fp8_block, scale_to_float
from kernels.fused import FUSED
from kernels.fused_fp8_linear import tiles


@pytest.fixture
def rounded():
    before = kernels.backend()
    kernels.set_backend("rounded")
    yield
    kernels.set_backend(before)


def _same(kernel_out, want) -> float:
    """The share of the kernel's outputs the reference holds exactly. The interpreter's float32 -> bf16 store
    truncates where the GPU rounds to nearest, so about half of a rounded reference's values match it here
    (all but accumulation-order ties on the GPU); a float32 reference's almost none."""
    return float((kernel_out.float() == want.float()).float().mean())


def _fp8_case(m: int, n: int, k: int):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g) / k**0.5, ue8m0=True)
    return x, q, scale_to_float(s)


@pytest.mark.parametrize("m", [3, 128])  # a GEMV (activations as stored) and the MMA's rows (quantized to e4m3)
def test_rounded_fp8_linear_is_far_closer_to_the_kernel(m, rounded):
    n, k = 256, 384
    x, q, s = _fp8_case(m, n, k)
    got = FUSED["linear"](x, q, s)
    assert (tiles(m, n, k)[0] == "mma") == (m == 128)  # both roundings of the served path are exercised
    near = ref.linear(x.float(), q, s)
    ref.set_rounding(None)
    far = ref.linear(x.float(), q, s)
    assert near.dtype == torch.float32 and torch.equal(near, near.bfloat16().float())  # values bf16 holds
    assert _same(got, near) > 0.3 and _same(got, far) < 0.05


def test_rounded_block_ops_are_far_closer_to_the_kernels(rounded):
    g = torch.Generator().manual_seed(5)
    T, hc, D = 5, 4, 256
    h = torch.randn(T, hc, D, generator=g).to(torch.bfloat16)
    out = torch.randn(T, D, generator=g).to(torch.bfloat16)
    post = torch.rand(T, hc, generator=g) * 2
    comb = torch.rand(T, hc, hc, generator=g)
    gate, up = (torch.randn(T, 512, generator=g).mul(4).to(torch.bfloat16) for _ in range(2))
    cases = [("hc_post", (h, out, post, comb)), ("swiglu", (gate, up, 10.0)),
             ("rms_norm", (out, torch.rand(D, generator=g) + 0.5, 1e-6))]
    for name, args in cases:
        got = FUSED[name](*args)
        up32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        near = getattr(ref, name)(*up32)
        ref.set_rounding(None)
        far = getattr(ref, name)(*up32)
        ref.set_rounding(torch.bfloat16)
        assert _same(got, near) > 0.3 and _same(got, far) < 0.05, (name, _same(got, near), _same(got, far))


@pytest.fixture
def reordered():
    before = kernels.backend()
    kernels.set_backend("reordered")
    yield
    kernels.set_backend(before)


def test_reordered_sums_the_same_products_in_another_order(reordered):
    """The noise floor's reference (tools/teacher_forced_floor.py): every contraction over its two halves of K
    and the MoE's rows in reverse. Without the bf16 stores it must give the same sums up to float32 order
    (every product counted once) and not bit for bit the same (the order did change); with them, only a few
    values move (where a stored value sits at a bf16 rounding midpoint), by a bf16 step or a few (a flip inside
    the MoE passes through its down projection)."""
    g = torch.Generator().manual_seed(11)
    T, D, H, E = 32, 1024, 4, 4
    x = torch.randn(T, D, generator=g)
    w = torch.randn(512, D, generator=g) / D**0.5
    gate_up = [torch.randn(E, 64, D, generator=g) / D**0.5 for _ in range(2)]
    w2 = torch.randn(E, D, 64, generator=g) / 8
    weights, indices = torch.rand(T, 2, generator=g), torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    kv = torch.randn(40, D, generator=g)
    cases = {
        "linear": lambda: ref.linear(x, w),
        "grouped_linear": lambda: ref.grouped_linear(x.view(T, 2, D // 2), w.view(2 * 512, D // 2), 2),
        "sink_attention": lambda: ref.sink_attention(x.view(T, 1, D).expand(T, H, D), kv,
                                                     torch.ones(T, 40, dtype=torch.bool), torch.zeros(H), D**-0.5),
        "moe_experts": lambda: ref.moe_experts(x, *gate_up, w2, weights, indices, 10.0),
    }
    moved = 0
    for name, run in cases.items():
        ref.set_rounding(None)
        reordered_sum = run()
        ref.set_reordered(False)
        plain = run()
        assert torch.allclose(reordered_sum, plain, rtol=1e-5, atol=1e-5), name
        assert not torch.equal(reordered_sum, plain), name
        ref.set_rounding(torch.bfloat16)
        plain = run()
        ref.set_reordered(True)
        diff = (run() - plain).abs()
        assert float(diff.max()) <= float(plain.abs().max()) * 2.0**-6, name  # a few bf16 steps of the largest
        assert float((diff > 0).float().mean()) < 0.05, name
        moved += int((diff > 0).sum())
    assert moved > 0
