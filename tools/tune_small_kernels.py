"""Time the knobs of the small fused kernels the way the engine runs them: inside a CUDA graph
(launch cost gone), at V4-Flash shapes, batch 1 and a big decode batch (and a prefill chunk for
attention). Prints a table and writes JSON; the defaults in kernels/ were chosen from it.

    python -m tools.tune_small_kernels [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import kernels.fused_indexer as fi
import kernels.fused_moe as fm
import kernels.fused_norm_mhc as fn
from kernels import quant_configs
from kernels.fused_attention import paged_attention_fused


def graph_ms(fn_, reps: int = 20, iters: int = 10) -> float:
    """ms per call: `reps` calls captured in one graph, replayed `iters` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn_()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn_()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (reps * iters)


def hc_pre_rows(dev):
    D = 4096
    for T in (1, 150):
        x = torch.randn(T, 4, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(24, 4 * D, device=dev) * 0.01
        base, scale = torch.zeros(24, device=dev), torch.ones(3, device=dev)
        for warps in (1, 2, 4, 8):
            fn.FINISH_WARPS = warps
            yield "hc_pre", f"T={T}", f"finish warps {warps}", graph_ms(
                partial(fn.hc_pre_fused, x, w, base, scale, 1e-6, 1e-6, 20))
    fn.FINISH_WARPS = 4


def _index_batch(dev, T, n_entries, per_block=32, H=64, d=128, ratio=4):
    nb = n_entries // per_block + 2
    pool = torch.randn(nb * T, per_block, d, device=dev, dtype=torch.bfloat16)
    tables = torch.arange(nb * T, device=dev).view(T, nb)
    pos = torch.full((T,), n_entries * ratio - 1, device=dev)
    iq = torch.randn(T, H, d, device=dev, dtype=torch.bfloat16)
    iw = torch.randn(T, H, device=dev) * H**-0.5
    return iq, iw, pool, tables, pos, torch.arange(T, device=dev)


def indexer_rows(dev):
    for T in (1, 150):
        iq, iw, pool, tables, pos, seq = _index_batch(dev, T, 2048)
        args = (iq, iw, pool, tables, pos, seq, 4, 512, 8191)
        for label, limit in (("sort kernel", 4096), ("torch.topk", 0)):
            fi.SORT_MAX = limit
            yield "indexer_topk (2048 entries)", f"T={T}", label, graph_ms(partial(fi.indexer_topk_fused, *args))
    fi.SORT_MAX = 4096


def attention_rows(dev):
    H, hd, W, bs, ratio, topk = 64, 512, 128, 128, 4, 512
    for T, ctx in ((1, 576), (150, 576), (2048, 512)):
        n_blocks = ctx // bs + 2
        S = T if T <= 150 else 4  # a prefill chunk: 4 sequences of 512 tokens
        window = torch.randn(S * n_blocks, bs, hd, device=dev, dtype=torch.bfloat16)
        comp = torch.randn(S * n_blocks, bs // ratio, hd, device=dev, dtype=torch.bfloat16)
        tables = torch.arange(S * n_blocks, device=dev).view(S, n_blocks)
        per = T // S
        pos = (torch.arange(T, device=dev) % per) + (ctx - per)
        seq = torch.arange(T, device=dev) // per
        q = torch.randn(T, H, hd, device=dev, dtype=torch.bfloat16)
        n_vis = (pos + 1) // ratio
        sel = torch.arange(topk, device=dev)[None].expand(T, -1)
        sel = torch.where(sel < n_vis[:, None], sel, -1).contiguous()
        sinks = torch.zeros(H, device=dev)
        args = (q, pos, seq, window, tables, torch.zeros(S, dtype=torch.long, device=dev), W, comp, tables, ratio,
                sel, sinks, hd**-0.5)
        for bh in (16, 32):
            yield "paged_attention CSA", f"T={T}", f"heads/program {bh}", graph_ms(
                partial(paged_attention_fused, *args, block_h=bh), reps=5 if T > 150 else 20)


def moe_rows(dev):
    E, k, D, I = 16, 6, 4096, 2048
    w1 = torch.randn(E, I, D, device=dev, dtype=torch.bfloat16) * 0.02
    w3, w2 = torch.randn_like(w1), torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02
    for T in (64, 150, 256):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
        wts = torch.rand(T, k, device=dev)
        for bm in (16, 64, quant_configs.moe_block_m(T, T * k, E)):
            cfg = {part: quant_configs.MOE_DECODE["dense"][bm] for part in ("gate_up", "down")}
            yield "moe_experts (16 experts)", f"T={T}", f"{bm}-row tiles", graph_ms(
                partial(fm.moe_experts_fused, x, w1, w3, w2, wts, idx, 10.0, config=cfg), reps=5)

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for gen in (hc_pre_rows, indexer_rows, attention_rows, moe_rows):
        for op, shape, variant, ms in gen(dev):
            rows.append({"op": op, "shape": shape, "variant": variant, "us": round(ms * 1e3, 2)})
            print(f"{op:30s} {shape:8s} {variant:22s} {ms * 1e3:9.2f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
