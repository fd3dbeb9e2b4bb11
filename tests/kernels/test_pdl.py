"""Programmatic dependent launch (kernels/pdl.py) off the GPU: the switch never reaches a CPU launch
(the interpreter has no grid-dependency ops), and tools/bench_pdl.py's chain computes what torch does."""

import pytest
import torch

from kernels import pdl, reference
from kernels.fused_norm_mhc import rms_norm_fused
from tools.bench_pdl import Chain


def test_switch_on_keeps_cpu_launches_plain():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).bfloat16()
    w = torch.rand(40, generator=g) + 0.5
    try:
        pdl.set_enabled(True)
        assert pdl.enabled() and pdl.options(x) == {"PDL": False}
        got = rms_norm_fused(x, w, 1e-6)  # a decode kernel launched with the switch on
    finally:
        pdl.set_enabled(False)
    # both sides round to bf16, whose step is 2**-7 of the value: a tolerance relative to it, not absolute
    assert torch.allclose(got.float(), reference.rms_norm(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("w_cols, prefetch", [(0, True), (4, True), (4, False)])
def test_chain_matches_torch(w_cols, prefetch):
    chain = Chain(3, 1500, w_cols, "cpu")  # 1500: a partial last block
    out = chain.run(pdl=False, prefetch=prefetch)
    assert torch.allclose(out, chain.expected(), rtol=1e-4, atol=1e-3)
    assert not torch.allclose(out, chain.x0, atol=0.5)  # the links add


def test_persistent_chain_matches_torch():
    """The persistent chain (one launch, dependency counters between links) computes the rotated chain torch
    computes; one program here: the interpreter runs programs one after another, so two would wait forever."""
    for w_cols in (0, 4):
        chain = Chain(3, 1024, w_cols, "cpu")
        out = chain.run_persistent()
        assert torch.allclose(out, chain.expected_persistent(), rtol=1e-4, atol=1e-3)
        assert not torch.allclose(out, chain.x0, atol=0.5)
        assert chain.counters.tolist() == [1, 1, 1]  # each link's one arrival
    bigger = Chain(3, 4096, 0, "cpu")
    want = bigger.expected_persistent()  # four slices: every link rotates them
    assert not torch.allclose(want, bigger.expected())
    with pytest.raises(ValueError, match="whole 1024-element slices"):
        Chain(2, 1500, 0, "cpu").run_persistent()


def test_engine_argument_modes_and_env_override(monkeypatch):
    """`pdl`: auto is off where PDL cannot run (the CPU), on / off as told, DSV4_PDL overrides; a bad value is
    refused with the choices."""
    from engine.args import EngineArgs, InvalidEngineArgs

    cpu = torch.device("cpu")
    assert EngineArgs().pdl == "auto" and not pdl.available(cpu)
    monkeypatch.delenv(pdl.ENV, raising=False)
    try:
        assert pdl.configure("auto", cpu) is False and not pdl.enabled()
        assert pdl.configure("on", cpu) is False and pdl.enabled()  # switched on, yet a CPU launch stays plain
        monkeypatch.setenv(pdl.ENV, "0")
        assert pdl.configure("on", cpu) is False and not pdl.enabled()
        monkeypatch.setenv(pdl.ENV, "1")
        pdl.configure("off", cpu)
        assert pdl.enabled()
        with pytest.raises(ValueError, match="pdl must be one of"):
            pdl.configure("yes", cpu)
    finally:
        pdl.set_enabled(False)
    with pytest.raises(InvalidEngineArgs, match=r"pdl must be one of \('auto', 'on', 'off'\)"):
        EngineArgs.from_dict({"pdl": "always"})
    assert EngineArgs.from_dict({"pdl": "auto"}).pdl == "auto"
