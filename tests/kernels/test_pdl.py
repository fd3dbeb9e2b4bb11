"""Programmatic dependent launch (kernels/pdl.py) off the GPU: the switch never reaches a CPU launch
(the interpreter has no grid-dependency ops), and tools/bench_pdl.py's chain computes what torch does."""

import pytest
import torch

from kernels import pdl, reference
from kernels.fused_norm_mhc import rms_norm_fused
from tools.bench_pdl import Chain


def test_switch_on_keeps_cpu_launches_plain():
    x = torch.randn(3, 40).bfloat16()
    w = torch.rand(40) + 0.5
    try:
        pdl.set_enabled(True)
        assert pdl.enabled() and pdl.options(x) == {"PDL": False}
        got = rms_norm_fused(x, w, 1e-6)  # a decode kernel launched with the switch on
    finally:
        pdl.set_enabled(False)
    assert torch.allclose(got.float(), reference.rms_norm(x, w, 1e-6).float(), atol=2e-2)


@pytest.mark.parametrize("w_cols, prefetch", [(0, True), (4, True), (4, False)])
def test_chain_matches_torch(w_cols, prefetch):
    chain = Chain(3, 1500, w_cols, "cpu")  # 1500: a partial last block
    out = chain.run(pdl=False, prefetch=prefetch)
    assert torch.allclose(out, chain.expected(), rtol=1e-4, atol=1e-3)
    assert not torch.allclose(out, chain.x0, atol=0.5)  # the links add
