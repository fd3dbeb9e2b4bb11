"""Decode MoE at one or a few tokens: the fused MoE's decode tiles (kernels/fused_moe.py) against the CUDA-core GEMV
(kernels/moe_gemv.py) and a few of its tiles, at V4-Flash's expert shapes (D 4096, I 2048, top-6): each checked
against the torch reference, timed in CUDA-graph replays over four routings (so the experts read are not the L2's),
next to the floor (the routed experts' stored bytes at the copy bandwidth). Prints a table, writes JSON.

    python -m tools.bench_moe_decode [--experts 16] [--fmt mxfp4] [--tokens 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from tools.bench_quant import _experts, _graph_time, _routing

D, I, TOPK = 4096, 2048, 6
COPY_BW = 4.2e12  # bytes/s, docs/PERF.md's measured copy bandwidth
GEMV_TILES = ({"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
              {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4}, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2})
BYTES_PER_WEIGHT = {"mxfp4": 0.5 + 1 / 32, "fp8": 1 + 4 / 128**2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_moe_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fmt", choices=("mxfp4", "fp8"), default="mxfp4")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the timings are CUDA-graph replays)", file=sys.stderr)
        return 1
    from kernels import quant_configs
    from kernels import reference as ref
    from kernels.fused_moe import moe_experts_fused
    from kernels.moe_gemv import moe_experts_gemv

    dev, E = torch.device("cuda"), a.experts
    w1, w3, w2, scales = _experts(E, D, I, a.fmt, dev)
    rows, bad = [], []
    print(f"MoE decode, {E} {a.fmt} experts: tokens | path (tiles) | us | rel err | floor us", flush=True)
    for T in (int(t) for t in a.tokens.split(",") if t):
        x = torch.randn(T, D, device=dev).bfloat16()
        routings = [_routing(T, E, TOPK, dev, seed=T * 10 + s) for s in range(4)]
        want = ref.moe_experts(x, w1, w3, w2, *routings[0], 10.0, scales).float()
        touched = sum(len(torch.unique(idx)) for _, idx in routings) / len(routings)
        floor = touched * 3 * D * I * BYTES_PER_WEIGHT[a.fmt] / COPY_BW * 1e6
        cfg = quant_configs.moe_config(T, T * TOPK, E, a.fmt)
        paths = [("fused decode tiles", functools.partial(moe_experts_fused, config=cfg), cfg["gate_up"])]
        paths += [("gemv", functools.partial(moe_experts_gemv, config=t), t) for t in GEMV_TILES]
        for name, fn, tiles in paths:
            try:
                err = ((fn(x, w1, w3, w2, *routings[0], 10.0, scales).float() - want).abs().max()
                       / want.abs().max()).item()
                us = _graph_time([functools.partial(fn, x, w1, w3, w2, rw, idx, 10.0, scales)
                                  for rw, idx in routings]) * 1e6
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, the rest runs
                print(f"{T} | {name} {tiles} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            rows.append({"tokens": T, "experts": E, "fmt": a.fmt, "path": name, "tiles": tiles, "us": us,
                         "rel_err": err, "floor_us": floor})
            if err > 2e-2:
                bad.append((T, name, tiles, err))
            print(f"{T} | {name} {tiles} | {us:.1f} | {err:.1e} | {floor:.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if bad:
        print(f"MISMATCH against the reference: {bad}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
