"""The compressors' multi-row step (kernels.compress_blocks) for tools/bench_fused.py: the fused
kernels checked against the torch reference on V4-Flash shapes, then both timed in CUDA graphs.

Shapes: the main CSA compressor (ratio 4, head 512, with the prefix-cache boundary state), the
indexer's (ratio 4, head 128) and HCA's (ratio 128, head 512); steps: a speculative verify of k + 1 = 4
rows per sequence at batch 1 and 32 (keeping the closed blocks, as the verify graphs do), and a
1000-token prefill chunk starting mid-block. Runs on the CPU too (TRITON_INTERPRET=1), for the check.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from engine.compress_plan import plan_arrays

SHAPES = (("csa4 h512", 4, 512, True), ("idx4 h128", 4, 128, True), ("hca128", 128, 512, False))
_FIELDS = ("src", "blk_seq", "blk_entry", "prev", "bnd_blk", "bnd_seq", "bnd_logical", "upd_slot", "upd_blk",
           "pend_row", "pend_dst")


def steps(small: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray, bool]]:
    """name -> (rows per sequence, first positions, keep the closed blocks)."""
    rng = np.random.default_rng(0)
    b = 4 if small else 32
    return {"ver1": (np.array([4]), np.array([1022]), True),
            f"ver{b}": (np.full(b, 4), rng.integers(0, 4000, b), True),
            "prefill": (np.array([120 if small else 1000]), np.array([130]), False)}


def case(name: str, m: int, hd: int, overlap: bool, step: tuple, device, seed: int = 0):
    """(args for compress_blocks but the state, a fresh state factory) for one shape and step."""
    n, starts, keep = step
    g = torch.Generator(device="cpu").manual_seed(seed)
    bs, S = 128, len(n)
    slots_n = S + 1
    width = -(-int((starts + n).max()) // bs) + 1
    nb = S * width + 1
    T = int(n.sum())
    arrays = plan_arrays(n, starts, starts, np.arange(S), m, bs, slots_n, T)
    plan = SimpleNamespace(ratio=m, num_blocks=len(arrays[1]),
                           **{k: torch.from_numpy(a.astype(np.int64)).to(device) for k, a in zip(_FIELDS, arrays)})
    c = 2 if overlap else 1
    bf, f32 = dict(dtype=torch.bfloat16), dict(dtype=torch.float32)

    def rnd(*shape, **dt):
        return torch.randn(*shape, generator=g).to(device=device, **dt)

    base = dict(pend_kv=rnd(slots_n, m, c * hd, **bf), pend_gate=rnd(slots_n, m, c * hd, **f32),
                prev_kv=rnd(slots_n, m, hd, **bf) if overlap else None,
                prev_gate=rnd(slots_n, m, hd, **f32) if overlap else None,
                has_prev=(torch.rand(slots_n, generator=g) < 0.7).to(device) if overlap else None,
                bnd_kv=rnd(nb, m, hd, **bf) if overlap else None, bnd_gate=rnd(nb, m, hd, **f32) if overlap else None)
    pool = rnd(nb, bs // m, hd, **bf)
    tables = torch.from_numpy(np.random.default_rng(seed).permutation(nb)[:S * width].reshape(S, width)).to(device)
    kv, gate = rnd(T, c * hd, **bf), rnd(T, c * hd, **bf)  # gate before its fp32 position bias, which the op adds
    ape = rnd(m, c * hd, **f32)
    positions = torch.from_numpy(np.concatenate([np.arange(s, s + k) for s, k in zip(starts, n)])).to(device)
    w, inv = (torch.rand(hd, generator=g) + 0.5).to(device), 1.0 / (10000 ** (torch.arange(0, 64, 2) / 64)).to(device)

    def fresh():
        st = SimpleNamespace(**{k: (v.clone() if v is not None else None) for k, v in base.items()})
        return st, pool.clone()

    return (kv, gate, plan, w, 1e-6, inv, tables, hd, keep, positions, ape), fresh


def run(fn, args, fresh):
    kv, gate, plan, w, eps, inv, tables, hd, keep, positions, ape = args
    st, pool = fresh()
    closed = fn(kv, gate, plan, st, w, eps, inv, pool, tables, hd, keep, positions, ape)
    return st, pool, closed


def check(device, small: bool = False) -> list[str]:
    from kernels import reference as ref
    from kernels.fused_compress_blocks import compress_blocks_fused

    failures = []
    for name, m, hd, overlap in SHAPES:
        for sname, step in steps(small).items():
            args, fresh = case(name, m, hd, overlap, step, device)
            (st0, p0, c0), (st1, p1, c1) = run(ref.compress_blocks, args, fresh), run(compress_blocks_fused, args, fresh)
            pairs = [("pool", p0, p1)] + [(k, getattr(st0, k), getattr(st1, k)) for k in vars(st0)
                                          if getattr(st0, k) is not None]
            if c0 is not None:
                pairs += [("closed kv", c0[0], c1[0]), ("closed gate", c0[1], c1[1])]
            for what, a, b in pairs:
                if a.dtype == torch.bool:
                    ok = torch.equal(a, b)
                else:
                    ok = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1.0)).item() <= 3e-2
                if not ok:
                    failures.append(f"compress_blocks {name} {sname}: {what} differs from the reference")
    return failures


def bench(device, timed, row) -> list[dict]:
    """timed([fn, ...]) -> (seconds, error); row(op, shape, rows, variant, s, floor, base, error) -> dict."""
    from kernels import reference as ref
    from kernels.fused_compress_blocks import compress_blocks_fused

    out = []
    for name, m, hd, overlap in SHAPES:
        for sname, step in steps().items():
            args, fresh = case(name, m, hd, overlap, step, device)
            states = [fresh() for _ in range(4)]
            kv, gate, plan, w, eps, inv, tables, hd_, keep, pos, ape = args
            calls = {fn: [lambda fn=fn, s=s: fn(kv, gate, plan, s[0], w, eps, inv, s[1], tables, hd_, keep, pos, ape)
                          for s in states] for fn in (ref.compress_blocks, compress_blocks_fused)}
            t_old, e_old = timed(calls[ref.compress_blocks])
            t_new, e_new = timed(calls[compress_blocks_fused])
            rows = int(step[0].sum())
            out.append(row("compress", f"{name} {sname}", rows, "torch ops (old)", t_old, None, error=e_old))
            out.append(row("compress", f"{name} {sname}", rows, "fused, 2-3 launches", t_new, None, t_old, e_new))
    return out
