"""The MoE on the CUDA cores at a few tokens (kernels/moe_gemv.py) vs the reference, in every stored format, with
pairs another rank computes (index -1); and the dispatcher's switch to it."""

import pytest
import torch

from kernels import fused_moe, quant_configs
from kernels import reference as ref
from kernels.moe_gemv import moe_experts_gemv
from tests.kernels.test_moe_grouped import _experts


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
@pytest.mark.parametrize("T, skipped", [(1, False), (3, True)])
def test_gemv_moe_matches_reference(fmt, T, skipped):
    """D 256 (two FP8 blocks), I 96 (off the 16-row tile and the 128 block: masked rows and K), top-3 of 8."""
    D, I, E, k = 256, 96 if fmt != "mxfp4" else 160, 8, 3
    g = torch.Generator().manual_seed(T + 5 * skipped)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    (w1, w3, w2), scales = _experts(fmt, E, D, I, g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if skipped:
        idx[0, 1] = -1
        idx[2] = -1
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    got = moe_experts_gemv(x, w1, w3, w2, w, idx, 10.0, scales)
    tol = 3e-2 if fmt == "fp8" else 2e-2  # the interpreter truncates float32 -> bf16 (test_moe_grouped says why)
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max().item()
    if skipped:
        assert got[2].abs().max() == 0


def test_dispatch_switch(monkeypatch):
    """moe_experts_fused takes the GEMV up to MOE_GEMV_MAX_TOKENS tokens (0, never, until measured)."""
    calls = []
    monkeypatch.setattr(quant_configs, "MOE_GEMV_MAX_TOKENS", 2)
    from kernels import moe_gemv

    monkeypatch.setattr(moe_gemv, "moe_experts_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or a[0])
    E, D, I, k = 4, 64, 32, 2
    w1, w3, w2 = torch.zeros(E, I, D), torch.zeros(E, I, D), torch.zeros(E, D, I)
    for T in (1, 2):
        fused_moe.moe_experts_fused(torch.zeros(T, D), w1, w3, w2, torch.zeros(T, k), torch.zeros(T, k, dtype=torch.long),
                                    10.0)
    assert calls == [1, 2]
