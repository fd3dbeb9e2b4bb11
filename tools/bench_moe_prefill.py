"""Prefill MoE, the two paths side by side: the fused kernels (kernels/fused_moe.py's prefill tiles) and the
experts unpacked to bf16 + torch's grouped GEMM (kernels/moe_grouped.py), at V4-Flash's expert shapes (D 4096,
I 2048, top-6), per token count: each checked against the torch reference, each timed in CUDA-graph replays
(which also shows the grouped path captures), next to the FLOP floor; the dispatch's pick beside them
(kernels.quant_configs.moe_grouped). Prints a table, writes JSON.

    python -m tools.bench_moe_prefill [--experts 16] [--fmt mxfp4] [--tokens 256,512,1024,2048,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from tools.bench_quant import _experts, _graph_time, _routing, finish

D, I, TOPK = 4096, 2048, 6
PEAK_BF16 = 790e12  # FLOP/s, docs/PERF.md's measured bf16 matmul ceiling


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_moe_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fmt", choices=("mxfp4", "fp8", "dense"), default="mxfp4")
    ap.add_argument("--tokens", default="256,512,1024,2048,4096")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the timings are CUDA-graph replays)", file=sys.stderr)
        return 1
    from kernels import quant_configs
    from kernels import reference as ref
    from kernels.fused_moe import moe_experts_fused
    from kernels.moe_grouped import moe_experts_grouped

    dev, E = torch.device("cuda"), a.experts
    if a.fmt == "dense":
        g = torch.Generator(device=dev).manual_seed(0)
        w1, w3 = ((torch.randn(E, I, D, device=dev, generator=g) / D**0.5).bfloat16() for _ in range(2))
        w2, scales = (torch.randn(E, D, I, device=dev, generator=g) / I**0.5).bfloat16(), None
    else:
        w1, w3, w2, scales = _experts(E, D, I, a.fmt, dev)
    rows = []
    print(f"MoE prefill, {E} {a.fmt} experts, D {D} I {I} top-{TOPK}: tokens | fused us (rel err) | grouped us "
          f"(rel err) | fused / grouped | FLOP floor us | dispatch picks", flush=True)
    for T in (int(t) for t in a.tokens.split(",") if t):
        rw, idx = _routing(T, E, TOPK, dev, seed=T)
        x = torch.randn(T, D, device=dev).bfloat16()
        want = ref.moe_experts(x, w1, w3, w2, rw, idx, 10.0, scales).float()
        cfg = quant_configs.moe_config(T, T * TOPK, E, a.fmt)  # a config keeps moe_experts_fused on its own kernels
        fused = functools.partial(moe_experts_fused, x, w1, w3, w2, rw, idx, 10.0, scales, config=cfg)
        grouped = functools.partial(moe_experts_grouped, x, w1, w3, w2, rw, idx, 10.0, scales)
        err = {name: ((fn().float() - want).abs().max() / want.abs().max()).item()
               for name, fn in (("fused", fused), ("grouped", grouped))}
        t_f, t_g = _graph_time([fused]) * 1e6, _graph_time([grouped]) * 1e6
        floor = 2 * T * TOPK * 3 * D * I / PEAK_BF16 * 1e6
        pick = "grouped" if quant_configs.moe_grouped(T * TOPK, E, E * I * D * 2 if scales else 0, a.fmt) else "fused"
        rows.append({"tokens": T, "experts": E, "fmt": a.fmt, "fused_us": t_f, "grouped_us": t_g,
                     "fused_rel_err": err["fused"], "grouped_rel_err": err["grouped"], "floor_us": floor, "pick": pick})
        print(f"{T} | {t_f:.1f} ({err['fused']:.1e}) | {t_g:.1f} ({err['grouped']:.1e}) | {t_f / t_g:.2f} | "
              f"{floor:.1f} | {pick}", flush=True)
    failures = [f"tokens {r['tokens']}: {path} relative error {r[path + '_rel_err']:.3g} > 2e-2"
                for r in rows for path in ("fused", "grouped") if r[path + "_rel_err"] > 2e-2]
    return finish("bench_moe_prefill", rows, a.json, failures)


if __name__ == "__main__":
    sys.exit(main())
