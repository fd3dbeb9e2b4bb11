"""What programmatic dependent launch (kernels/pdl.py) saves per kernel boundary on this GPU: a chain
of N small Triton kernels, each reading its predecessor's output, with and without PDL, launched
eagerly and replayed from one CUDA graph (does stream capture keep the programmatic edges?).

    python -m tools.bench_pdl [--links 200] [--elems 8192] [--weight-kb 0,1024] [--json OUT]   (suite pdl_chain, ~1 min)

Each link reads `weight-kb` of weights no predecessor writes (0: a bare launch-bound link) and the
predecessor's vector, and writes its own. With PDL the weights are read before the grid-dependency wait
(`prefetch`: what a GEMV's weight stream gains) or after it (`no prefetch`: launch overlap alone).
Rows: per-link time and the saving per boundary against the same chain without PDL. The chain's result
is checked against torch first (exit 1 on a mismatch): a missing wait would read a stale vector.
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
def _weights_sum(w_ptr, offs, mask, W_COLS: tl.constexpr):
    cols = tl.arange(0, W_COLS)
    return tl.sum(tl.load(w_ptr + offs[:, None] * W_COLS + cols[None, :], mask=mask[:, None], other=0.0), axis=1)


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
        add = _weights_sum(w_ptr, offs, mask, W_COLS)
        wait_and_release(PDL)
    else:
        wait_and_release(PDL)
        add = _weights_sum(w_ptr, offs, mask, W_COLS)
    x = tl.load(src_ptr + offs, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, x + add, mask=mask)


class Chain:
    """N links ping-ponging between two vectors; link i reads weights[i] (none when w_cols is 0)."""

    def __init__(self, links: int, elems: int, w_cols: int, device):
        self.links, self.n, self.w_cols = links, elems, w_cols
        self.x0 = torch.randn(elems, device=device)
        self.bufs = [self.x0.clone(), torch.empty_like(self.x0)]
        self.w = torch.rand(links, elems, max(w_cols, 1), device=device) if w_cols else None

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


def check(chain: Chain, pdl: bool, prefetch: bool, graph: bool) -> bool:
    if graph:
        g = torch.cuda.CUDAGraph()
        chain.run(pdl, prefetch)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = chain.run(pdl, prefetch)
        chain.bufs[0].zero_()
        g.replay()
        torch.cuda.synchronize()
    else:
        out = chain.run(pdl, prefetch)
    return torch.allclose(out, chain.expected(), rtol=1e-4, atol=1e-3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=200)
    ap.add_argument("--elems", type=int, default=8192, help="vector length (programs: elems / 1024)")
    ap.add_argument("--weight-kb", default="0,1024", help="weights each link reads, KiB (0: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}; {a.links} links of {a.elems} floats", flush=True)
    rows, failures = [], []
    for kb in (int(v) for v in a.weight_kb.split(",")):
        w_cols = triton.next_power_of_2(max(1, kb * 1024 // 4 // a.elems)) if kb else 0
        chain = Chain(a.links, a.elems, w_cols, dev)
        variants = [("off", False, True)] + ([("pdl", True, True)] if not w_cols else
                                             [("pdl prefetch", True, True), ("pdl no prefetch", True, False)])
        for mode in ("eager", "graph"):
            for name, pdl, prefetch in variants:
                try:
                    ok = check(chain, pdl, prefetch, mode == "graph")
                except Exception as e:  # e.g. no launch_pdl in this Triton: named, the rest runs
                    ok = False
                    print(f"  {mode} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                if not ok:
                    failures.append(f"{mode} {name} weights {kb} KiB: wrong result or failed")
        for mode, timer in (("eager", _eager_ms), ("graph", _graph_ms)):
            base = None
            for name, pdl, prefetch in variants:
                if any(f.startswith(f"{mode} {name} weights {kb} KiB") for f in failures):
                    continue
                ms = timer(lambda pdl=pdl, prefetch=prefetch: chain.run(pdl, prefetch))
                us_link = ms * 1e3 / a.links
                base = us_link if base is None else base
                row = {"weight_kb": w_cols * a.elems * 4 // 1024, "mode": mode, "variant": name,
                       "us_per_link": us_link, "saving_us_per_boundary": base - us_link}
                rows.append(row)
                print(f"  weights {row['weight_kb']:>5} KiB  {mode:<5} {name:<16} {us_link:7.2f} us/link  "
                      f"saving {row['saving_us_per_boundary']:+.2f} us/boundary", flush=True)
    for f in failures:
        print("FAIL", f, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"links": a.links, "elems": a.elems, "rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
