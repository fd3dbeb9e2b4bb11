"""Fused compressor decode step vs the reference: every piece of state it writes (open block,
overlap slice, has_prev, boundary state, pool entries) after a batch where some sequences close
a block (one at a full-block end) and some do not."""

import pytest
import torch

from kernels import reference as ref
from kernels.fused_compress import compress_decode_fused


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("ratio, overlap", [(4, True), (16, False)])
@pytest.mark.parametrize("with_ape", [False, True])
def test_compress_decode(dtype, tol, ratio, overlap, with_ape):
    """with_ape: the gate in the model dtype and its position bias added inside, kv and gate strided column
    slices of one tensor (the engine's decode)."""
    g = torch.Generator().manual_seed(ratio)
    hd, r, bs, slots_n, nb = 32, 8, 32, 6, 24
    c = 2 if overlap else 1
    positions = torch.tensor([ratio - 1, 5 * ratio - 1, bs - 1, 2, ratio + 1, 0])  # 3 close a block, 1 at bs
    S = positions.shape[0]
    slots = torch.tensor([4, 0, 2, 5, 1, 3])
    state = {
        "pend_kv": torch.randn(slots_n, ratio, c * hd, generator=g).to(dtype),
        "pend_gate": torch.randn(slots_n, ratio, c * hd, generator=g).float(),
        "prev_kv": torch.randn(slots_n, ratio, hd, generator=g).to(dtype) if overlap else None,
        "prev_gate": torch.randn(slots_n, ratio, hd, generator=g).float() if overlap else None,
        "has_prev": torch.tensor([True, False, True, True, False, True]) if overlap else None,
        "bnd_kv": torch.randn(nb, ratio, hd, generator=g).to(dtype) if overlap else None,
        "bnd_gate": torch.randn(nb, ratio, hd, generator=g).float() if overlap else None,
        "pool": torch.randn(nb, bs // ratio, hd, generator=g).to(dtype),
    }
    kv = torch.randn(S, c * hd, generator=g).to(dtype)
    gate = torch.randn(S, c * hd, generator=g).float()
    ape = None
    if with_ape:
        gate, ape = gate.to(dtype), torch.randn(ratio, c * hd, generator=g)
        wide = torch.cat([gate, kv, kv[:, :3]], dim=1)  # as the model's: column slices of one stacked GEMM output
        gate, kv = wide[:, :c * hd], wide[:, c * hd:2 * c * hd]
    tables = torch.randperm(nb, generator=g)[: S * 4].view(S, 4)
    w, inv = torch.rand(hd, generator=g) + 0.5, 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    copies = [{k: (v.clone() if v is not None else None) for k, v in state.items()} for _ in range(2)]
    for fn, st in ((ref.compress_decode, copies[0]), (compress_decode_fused, copies[1])):
        fn(kv, gate, positions, slots, st["pend_kv"], st["pend_gate"], st["prev_kv"], st["prev_gate"], st["has_prev"],
           st["bnd_kv"], st["bnd_gate"], w, 1e-6, inv, st["pool"], tables, bs, ratio, hd, ape=ape)
    for k in state:
        if state[k] is None:
            continue
        a, b = copies[0][k], copies[1][k]
        if a.dtype == torch.bool:
            assert torch.equal(a, b), k
        else:
            assert (a.float() - b.float()).abs().max() <= tol * max(a.float().abs().max().item(), 1.0), k
    assert not torch.equal(copies[1]["pool"], state["pool"])  # entries were written
