"""What a kernel boundary costs on this GPU, and what programmatic dependent launch (kernels/pdl.py) or one
persistent kernel saves of it: a chain of N small Triton kernels, each reading its predecessor's output,
with and without PDL, launched eagerly and replayed from one CUDA graph (does stream capture keep the
programmatic edges?), against the same N links run by one launch whose programs stay resident and wait
on dependency counters between links (the mechanism of a persistent decode step).

    python -m tools.bench_pdl [--links 200] [--elems 8192,131072] [--weight-kb 0,1024] [--json OUT]
    (suite pdl_chain, ~1 min)

Each link reads `weight-kb` of weights no predecessor writes (0: a bare launch-bound link) and the
predecessor's vector, and writes its own. With PDL the weights are read before the grid-dependency wait
(`prefetch`: what a GEMV's weight stream gains) or after it (`no prefetch`: launch overlap alone); the
persistent chain reads link i's weights before waiting for link i - 1 (the same prefetch). Every program
of a persistent link reads another program's slice of its predecessor (as a GEMV reads the whole input),
so a counter that released early would read a stale vector. Rows: per-link time and the saving per
boundary against the same chain without PDL. Each chain's result is checked against torch first (exit 1
on a mismatch).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from kernels.pdl import wait_and_release
from tools.bench_kernels import time_ms

BLOCK = 1024


@triton.jit
def _weights_sum(w_ptr, offs, mask, W_COLS: tl.constexpr, CHUNK: tl.constexpr):
    """Row sums of [BLOCK, W_COLS] weights, CHUNK columns a load (the persistent chain's: a whole tile held across
    its wait spills, 255 registers at 32 columns; the launches' chains load it whole, CHUNK = W_COLS)."""
    add = tl.zeros(offs.shape, tl.float32)
    for c in tl.static_range(0, W_COLS, CHUNK):
        cols = c + tl.arange(0, CHUNK)
        add += tl.sum(tl.load(w_ptr + offs[:, None] * W_COLS + cols[None, :], mask=mask[:, None], other=0.0), axis=1)
    return add


@triton.jit
def _link_kernel(src_ptr, dst_ptr, w_ptr, n, W_COLS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """dst = src + (row sums of this link's weights, or 1 without weights)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if W_COLS == 0:
        wait_and_release(PDL)
        add = tl.full((BLOCK,), 1.0, tl.float32)
    elif PREFETCH:  # the weights no predecessor writes: in flight before the wait
        add = _weights_sum(w_ptr, offs, mask, W_COLS, W_COLS)
        wait_and_release(PDL)
    else:
        wait_and_release(PDL)
        add = _weights_sum(w_ptr, offs, mask, W_COLS, W_COLS)
    x = tl.load(src_ptr + offs, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, x + add, mask=mask)


@triton.jit
def _persistent_chain_kernel(buf_ptr, w_ptr, cnt_ptr, n, links, W_COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Every link in one launch: program p writes link i's slice p as _link_kernel's program p would, from its
    predecessor's slice p + 1 (mod the programs). Between links it waits until link i - 1's counter holds every
    program's arrival (all programs resident: the caller launches at most one per SM); link i's weights are read
    before that wait. The two vectors ping-pong in buf [2, n]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src_offs = ((pid + 1) % programs) * BLOCK + tl.arange(0, BLOCK)
    for i in range(links):
        if W_COLS == 0:
            add = tl.full((BLOCK,), 1.0, tl.float32)
        else:
            add = _weights_sum(w_ptr + i * n * W_COLS, offs, mask, W_COLS, 8 if W_COLS > 8 else W_COLS)
        if i > 0:
            while tl.atomic_add(cnt_ptr + i - 1, 0, sem="acquire") < programs:
                pass
        x = tl.load(buf_ptr + (i % 2) * n + src_offs, mask=src_offs < n, other=0.0, volatile=True)
        tl.store(buf_ptr + ((i + 1) % 2) * n + offs, x + add, mask=mask)
        tl.debug_barrier()  # every thread's store before the arrival's release
        tl.atomic_add(cnt_ptr + i, 1, sem="release")


class Chain:
    """N links ping-ponging between two vectors; link i reads weights[i] (none when w_cols is 0)."""

    def __init__(self, links: int, elems: int, w_cols: int, device):
        self.links, self.n, self.w_cols = links, elems, w_cols
        self.x0 = torch.randn(elems, device=device)
        self.bufs = [self.x0.clone(), torch.empty_like(self.x0)]
        self.w = torch.rand(links, elems, max(w_cols, 1), device=device) if w_cols else None
        self.pair = torch.empty(2, elems, device=device)  # the persistent chain's two vectors
        self.counters = torch.zeros(links, dtype=torch.int32, device=device)

    def run_persistent(self) -> torch.Tensor:
        """The chain as one launch (elems a multiple of BLOCK: each program owns whole slices it rotates)."""
        if self.n % BLOCK:
            raise ValueError(f"the persistent chain takes whole {BLOCK}-element slices, not {self.n} elements")
        self.pair[0].copy_(self.x0)
        self.counters.zero_()
        w = self.w if self.w is not None else self.pair
        _persistent_chain_kernel[(self.n // BLOCK,)](self.pair, w, self.counters, self.n, self.links,
                                                     W_COLS=self.w_cols, BLOCK=BLOCK)
        return self.pair[self.links % 2]

    def expected_persistent(self) -> torch.Tensor:
        x = self.x0.view(-1, BLOCK)
        for i in range(self.links):
            add = self.w[i].sum(-1) if self.w is not None else torch.ones_like(self.x0)
            x = torch.roll(x, -1, dims=0) + add.view(-1, BLOCK)
        return x.reshape(-1)

    def run(self, pdl: bool, prefetch: bool = True) -> torch.Tensor:
        self.bufs[0].copy_(self.x0)
        grid = (triton.cdiv(self.n, BLOCK),)
        opts = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
        for i in range(self.links):
            src, dst = self.bufs[i % 2], self.bufs[(i + 1) % 2]
            w = self.w[i] if self.w is not None else src
            _link_kernel[grid](src, dst, w, self.n, W_COLS=self.w_cols, BLOCK=BLOCK, PREFETCH=prefetch, **opts)
        return self.bufs[self.links % 2]

    def expected(self) -> torch.Tensor:
        add = self.w.sum(-1).sum(0) if self.w is not None else torch.full_like(self.x0, float(self.links))
        return self.x0 + add


def _eager_ms(fn, reps: int = 10) -> float:
    return time_ms(fn, reps)


def _graph_ms(fn, reps: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _eager_ms(graph.replay, reps)


def _runner(chain: Chain, name: str, pdl: bool, prefetch: bool):
    return chain.run_persistent if name == "persistent" else (lambda: chain.run(pdl, prefetch))


def check(chain: Chain, name: str, pdl: bool, prefetch: bool, graph: bool) -> bool:
    run = _runner(chain, name, pdl, prefetch)
    if graph:
        g = torch.cuda.CUDAGraph()
        run()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = run()
        chain.bufs[0].zero_()
        chain.pair.zero_()
        g.replay()
        torch.cuda.synchronize()
    else:
        out = run()
    want = chain.expected_persistent() if name == "persistent" else chain.expected()
    return torch.allclose(out, want, rtol=1e-4, atol=1e-3)


def chain_rows(links: int, elems: int, kb: int, dev, sms: int, failures: list) -> list[dict]:
    """Every variant of one chain (elems floats, kb KiB of weights a link) checked, then timed eagerly and in a graph."""
    w_cols = triton.next_power_of_2(max(1, kb * 1024 // 4 // elems)) if kb else 0
    chain = Chain(links, elems, w_cols, dev)
    variants = [("off", False, True)] + ([("pdl", True, True)] if not w_cols else
                                         [("pdl prefetch", True, True), ("pdl no prefetch", True, False)])
    if elems % BLOCK == 0 and elems // BLOCK <= sms:  # a program per SM at most: all resident, or the counters hang
        variants.append(("persistent", False, True))
    tag = f"{elems} floats, weights {w_cols * elems * 4 // 1024} KiB"
    bad = set()
    for mode in ("eager", "graph"):
        for name, pdl, prefetch in variants:
            try:
                ok = check(chain, name, pdl, prefetch, mode == "graph")
            except Exception as e:  # e.g. no launch_pdl in this Triton: named, the rest runs
                ok = False
                print(f"  {mode} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if not ok:
                bad.add((mode, name))
                failures.append(f"{mode} {name}, {tag}: wrong result or failed")
    rows = []
    for mode, timer in (("eager", _eager_ms), ("graph", _graph_ms)):
        base = None
        for name, pdl, prefetch in variants:
            if (mode, name) in bad:
                continue
            us_link = timer(_runner(chain, name, pdl, prefetch)) * 1e3 / links
            base = us_link if base is None else base
            row = {"elems": elems, "programs": triton.cdiv(elems, BLOCK), "weight_kb": w_cols * elems * 4 // 1024,
                   "mode": mode, "variant": name, "us_per_link": us_link, "saving_us_per_boundary": base - us_link}
            rows.append(row)
            print(f"  {row['programs']:>3} programs  weights {row['weight_kb']:>5} KiB  {mode:<5} {name:<16} "
                  f"{us_link:7.2f} us/link  saving {row['saving_us_per_boundary']:+.2f} us/boundary", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=200)
    ap.add_argument("--elems", default="8192,131072", help="vector lengths (programs: elems / 1024)")
    ap.add_argument("--weight-kb", default="0,1024", help="weights each link reads, KiB (0: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}; chains of {a.links} links", flush=True)
    rows, failures = [], []
    for elems in (int(v) for v in a.elems.split(",")):
        for kb in (int(v) for v in a.weight_kb.split(",")):
            rows += chain_rows(a.links, elems, kb, dev, sms, failures)
    for f in failures:
        print("FAIL", f, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"links": a.links, "rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
