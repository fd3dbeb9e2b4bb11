"""Fused compressor multi-row step vs the reference (kernels.reference.compress_blocks) on random
plans (engine/compress_plan.py's plan_arrays): several sequences per step, blocks closed from this
step's rows only and from the open block plus this step's rows, chunks closing several blocks,
replayed rows below compress_from, sequences closing none; HCA and CSA (overlap), with and without
the prefix-cache boundary state, with and without keeping the closed blocks (speculative verify),
and padded the way the CUDA-graph batches pad the plan (entries that read row 0 and write only a
scratch block and slot). Every piece of state either writes is compared."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.compress_plan import plan_arrays
from kernels import reference as ref
from kernels.fused_compress_blocks import compress_blocks_fused

_STATE = ("pend_kv", "pend_gate", "prev_kv", "prev_gate", "has_prev", "bnd_kv", "bnd_gate")


def _case(seed, ratio, overlap, boundary, dtype, padded, ape=False):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    hd, bs = 32, 4 * ratio
    c = 2 if overlap else 1
    S = int(rng.integers(2, 5))
    slots_n, nb = S + 3, 8 * S + 4  # the last slot and block: the scratch ones
    n = rng.integers(1, 3 * ratio + 3, S)
    starts = rng.integers(0, 3 * ratio, S)
    cfrom = np.where(rng.random(S) < 0.3, starts + rng.integers(0, ratio + 2, S), starts)  # bounded replay
    slots = rng.permutation(slots_n - 1)[:S]
    T = int(n.sum())
    arrays = plan_arrays(n, starts, cfrom, slots, ratio, bs, slots_n, T + 3 if padded else T)  # rows incl. padding
    width = -(-int((starts + n).max()) // bs) + 1
    tables = torch.from_numpy(rng.permutation(nb - 1)[:(S + 1) * width].reshape(S + 1, width).copy())
    if padded:  # a padding sequence (batch index S) on the scratch block; the plan's arrays padded as the graphs do
        tables[S] = nb - 1
        nbl = len(arrays[1]) + 2
        caps = (nbl * ratio, nbl, nbl, nbl, nbl, nbl, nbl, S + 1, S + 1, T + 3, T + 3)
        vals = (0, S, 0, 0, 0, S, 0, slots_n - 1, 0, 0, (slots_n - 1) * ratio)
        arrays = [np.concatenate([a, np.full(cap - len(a), v)]) for a, cap, v in zip(arrays, caps, vals)]
        T += 3  # 3 padding rows after the real ones
    plan = SimpleNamespace(ratio=ratio, num_blocks=len(arrays[1]), **{k: torch.from_numpy(a.astype(np.int64)) for k, a in zip(
        ("src", "blk_seq", "blk_entry", "prev", "bnd_blk", "bnd_seq", "bnd_logical", "upd_slot", "upd_blk", "pend_row",
         "pend_dst"), arrays)})
    gdt = torch.promote_types(dtype, torch.float32)
    state = {
        "pend_kv": torch.randn(slots_n, ratio, c * hd, generator=g).to(dtype),
        "pend_gate": torch.randn(slots_n, ratio, c * hd, generator=g).to(gdt),
        "prev_kv": torch.randn(slots_n, ratio, hd, generator=g).to(dtype) if overlap else None,
        "prev_gate": torch.randn(slots_n, ratio, hd, generator=g).to(gdt) if overlap else None,
        "has_prev": torch.rand(slots_n, generator=g) < 0.6 if overlap else None,
        "bnd_kv": torch.randn(nb, ratio, hd, generator=g).to(dtype) if overlap and boundary else None,
        "bnd_gate": torch.randn(nb, ratio, hd, generator=g).to(gdt) if overlap and boundary else None,
        "pool": torch.randn(nb, bs // ratio, hd, generator=g).to(dtype),
    }
    kv = torch.randn(T, c * hd, generator=g).to(dtype)
    if ape:  # the projection in the model dtype; the op adds the fp32 position bias of each row's position
        gate = (torch.randn(T, c * hd, generator=g) * 2).to(dtype)
        positions = torch.zeros(T, dtype=torch.long)  # padding rows: position 0
        positions[:int(n.sum())] = torch.from_numpy(np.concatenate([np.arange(s, s + k) for s, k in zip(starts, n)]))
        bias = (torch.randn(ratio, c * hd, generator=g), positions)
        wide = torch.cat([kv, gate, kv[:, :5]], dim=1)  # as the model's: column slices of one stacked GEMM output
        kv, gate = wide[:, :c * hd], wide[:, c * hd:2 * c * hd]
    else:
        gate = torch.randn(T, c * hd, generator=g).float() * 2  # fp32: the projection plus the fp32 position bias
        bias = None
    return plan, state, kv, gate, tables, hd, slots_n - 1, nb - 1, bias


def _run(fn, plan, state, kv, gate, tables, hd, keep, bias=None):
    st = {k: (v.clone() if v is not None else None) for k, v in state.items()}
    r = 8
    w = torch.linspace(0.5, 1.5, hd)
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    ns = SimpleNamespace(**{k: st[k] for k in _STATE})
    ape, positions = bias if bias is not None else (None, None)
    closed = fn(kv, gate, plan, ns, w, 1e-6, inv, st["pool"], tables, hd, keep, positions, ape)
    return st, closed


def _close(a, b, tol, what):
    if a.dtype == torch.bool:
        assert torch.equal(a, b), what
    else:
        assert (a.float() - b.float()).abs().max() <= tol * max(a.float().abs().max().item(), 1.0), what


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("ratio, overlap, boundary", [(4, True, True), (4, True, False), (8, False, False)])
@pytest.mark.parametrize("padded, keep, ape", [(False, False, False), (True, True, False), (True, True, True),
                                               (False, False, True)])
def test_compress_blocks_equals_the_reference(dtype, tol, ratio, overlap, boundary, padded, keep, ape):
    for seed in range(3):
        plan, state, kv, gate, tables, hd, scratch_slot, scratch_blk, bias = _case(
            seed * 7 + ratio, ratio, overlap, boundary, dtype, padded, ape)
        (want, wclosed), (got, gclosed) = (_run(fn, plan, state, kv, gate, tables, hd, keep, bias)
                                           for fn in (ref.compress_blocks, compress_blocks_fused))
        real = torch.ones(state["pend_kv"].shape[0], dtype=torch.bool)
        real[scratch_slot] = False  # padding writes land here, in no defined order: not compared
        for k, v in want.items():
            if v is None:
                continue
            keep_rows = real if v.shape[0] == real.shape[0] else torch.arange(v.shape[0]) != scratch_blk
            _close(v[keep_rows], got[k][keep_rows], tol, (seed, k))
        assert not torch.equal(got["pool"], state["pool"]) or plan.num_blocks == 0
        assert (wclosed is None) == (gclosed is None) == (not keep or plan.num_blocks == 0)
        if wclosed is not None:
            # gathered rows: exact; the padding blocks' rows only where no position bias (theirs differ, unread)
            real = int((plan.blk_seq < tables.shape[0] - 1).sum()) if padded and ape else None
            for a, b in zip(wclosed, gclosed):
                assert a.shape == b.shape and torch.equal(a[:real], b[:real]), seed


def test_hand_built_step_open_block_overlap_and_boundary():
    """A hand-built step: sequence 0 holds 2 open rows and adds 8 (closes its block 0 from the open
    block + this step, then block 1 from this step only, whose overlap is block 0's Ca slice; 2 rows
    stay open, in the open block's rows 0-1 that block 0 read); sequence 1 closes its block 3 with
    the state's overlap slice at a full cache block's end (the boundary state)."""
    m, bs, hd, T = 4, 16, 32, 11
    n, starts, slots = np.array([8, 3]), np.array([2, 13]), np.array([1, 0])
    arrays = plan_arrays(n, starts, starts, slots, m, bs, 3, T)
    assert arrays[0].tolist()[:4] == [T + 4, T + 5, 0, 1] and arrays[3].tolist() == [1, 3 + 0, 0]
    assert arrays[4].tolist() == [2] and arrays[9].tolist() == [6, 7] and arrays[10].tolist() == [4, 5]
    g = torch.Generator().manual_seed(0)
    plan = SimpleNamespace(ratio=m, num_blocks=3, **{k: torch.from_numpy(a) for k, a in zip(
        ("src", "blk_seq", "blk_entry", "prev", "bnd_blk", "bnd_seq", "bnd_logical", "upd_slot", "upd_blk", "pend_row",
         "pend_dst"), arrays)})
    state = {"pend_kv": torch.randn(3, m, 2 * hd, generator=g), "pend_gate": torch.randn(3, m, 2 * hd, generator=g),
             "prev_kv": torch.randn(3, m, hd, generator=g), "prev_gate": torch.randn(3, m, hd, generator=g),
             "has_prev": torch.tensor([True, True, False]), "bnd_kv": torch.zeros(8, m, hd),
             "bnd_gate": torch.zeros(8, m, hd), "pool": torch.zeros(8, bs // m, hd)}
    kv, gate = torch.randn(T, 2 * hd, generator=g), torch.randn(T, 2 * hd, generator=g)
    tables = torch.tensor([[5, 6], [2, 3]])
    (want, _), (got, closed) = (_run(fn, plan, state, kv, gate, tables, hd, True)
                                for fn in (ref.compress_blocks, compress_blocks_fused))
    for k, v in want.items():
        _close(v, got[k], 1e-5, k)
    assert torch.equal(closed[0][0, :2], state["pend_kv"][1, :2]) and torch.equal(closed[0][0, 2:], kv[:2])
    assert torch.equal(got["pend_kv"][1, :2], kv[6:8])  # the open rows after block 0 read the old ones
    ca = torch.cat([state["pend_kv"][0, :1, :hd], kv[8:11, :hd]])
    assert torch.equal(got["bnd_kv"][2], ca) and torch.equal(got["prev_kv"][0], ca)
    assert torch.equal(got["prev_kv"][1], kv[2:6, :hd]) and bool(got["has_prev"][1])
    for blk, entry in ((5, 0), (5, 1), (2, 3)):
        assert got["pool"][blk, entry].abs().sum() > 0
