"""Prefill MoE, the two paths side by side: the fused kernels (kernels/fused_moe.py's prefill tiles) and the
experts unpacked to bf16 + torch's grouped GEMM (kernels/moe_grouped.py), at V4-Flash's expert shapes (D 4096,
I 2048, top-6): each checked against the torch reference, each timed in CUDA-graph replays (which also shows
the grouped path captures), next to the FLOP floor; the dispatch's pick beside them (kernels.quant_configs.
moe_grouped). Per token count (`--tokens`), or per rows per expert (`--rows-per-expert`: tokens = rows x
experts / top-k) at each of `--experts`; then the dispatch rule fitted from the rows: per expert count, the
rows per expert from which the grouped path wins at every measured size (the table quant_configs.
MOE_GROUPED_MIN_ROWS holds), printed as that table's entry. Prints a table, writes JSON {"rows", "rule"}.

    python -m tools.bench_moe_prefill [--experts 16] [--fmt mxfp4] [--tokens 256,512,1024,2048,4096] [--json out.json]
    python -m tools.bench_moe_prefill --experts 16,64,128,256 --rows-per-expert 16,32,64,96,128,192,256,384,512
    python -m tools.bench_moe_prefill --experts 16,256 --rows-per-expert 96,192,384 --tiles 128x128x128w8s3:bf16-frag

`--tiles`: fused tiles beside the table's (pairs x weight rows x K step, warps, stages, the MXFP4 decode), each
checked and timed at every size; the rule is still fitted from the table's tile (the engine's).

Without a GPU it runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, set here) on small sizes
(`--dims 128,128 --experts 2,4 --topk 2 --rows-per-expert 2,4`): the arithmetic and the fit, not the timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import torch

from tools.kernel_device import call_timer, gpu_or_interpreter

D, I, TOPK = 4096, 2048, 6
PEAK_BF16 = 790e12  # FLOP/s, docs/PERF.md's measured bf16 matmul ceiling


def tokens_for(rows_per_expert: int, experts: int, topk: int) -> int:
    """Tokens whose top-k pairs give each expert `rows_per_expert` rows on average."""
    return max(1, math.ceil(rows_per_expert * experts / topk))


def parse_tile(spec: str) -> dict:
    """'BMxBNxBKwWsS:MX' (MX optional) -> a fused MoE config for both parts, as moe_experts_fused takes it."""
    shape, _, mx = spec.partition(":")
    dims, _, rest = shape.partition("w")
    warps, _, stages = rest.partition("s")
    try:
        bm, bn, bk = (int(v) for v in dims.split("x"))
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": int(warps), "num_stages": int(stages)}
    except ValueError:
        raise ValueError(f"tile {spec!r}: BMxBNxBKwWARPSsSTAGES[:MX], e.g. 128x128x128w8s3:bf16-frag") from None
    cfg |= {"MX": mx} if mx else {}
    return {"gate_up": cfg, "down": cfg}


def fit_rule(rows: list[dict]) -> dict[int, int | None]:
    """Per expert count: the smallest measured rows per expert from which the grouped path is faster at
    that size and every larger one measured (None: not at the largest). Sizes the decode tiles take
    (quant_configs.MOE_DECODE_MAX_PAIRS) count too: the rule's floor is the engine's, not the fit's."""
    rule: dict[int, int | None] = {}
    for e in sorted({r["experts"] for r in rows}):
        mine = sorted((r for r in rows if r["experts"] == e), key=lambda r: r["rows_per_expert"])
        start = None
        for r in reversed(mine):
            if r["grouped_us"] >= r["fused_us"]:
                break
            start = r["rows_per_expert"]
        rule[e] = start
    return rule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_moe_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="16", help="expert counts, e.g. 16,64,128,256")
    ap.add_argument("--fmt", choices=("mxfp4", "fp8", "dense"), default="mxfp4")
    ap.add_argument("--tokens", default="256,512,1024,2048,4096", help="token counts (without --rows-per-expert)")
    ap.add_argument("--rows-per-expert", default="", help="average rows per expert (tokens from them, per expert "
                    "count), e.g. 16,32,64,128,256,512")
    ap.add_argument("--dims", default=f"{D},{I}", help="hidden size D and expert width I")
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--tiles", default="", help="fused tiles timed beside the table's, comma-separated "
                    "BMxBNxBKwWARPSsSTAGES[:MX], e.g. 128x128x128w8s3:bf16-frag")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        tiles = {spec: parse_tile(spec) for spec in a.tiles.split(",") if spec}
    except ValueError as e:
        ap.error(str(e))
    dev = gpu_or_interpreter()  # before the kernels' modules load
    on_gpu = dev.type == "cuda"
    from kernels import quant_configs
    from kernels import reference as ref
    from kernels.fused_moe import moe_experts_fused
    from kernels.moe_grouped import moe_experts_grouped
    from tools.bench_quant import _experts, _routing

    d, i = (int(v) for v in a.dims.split(","))
    k, timed = a.topk, call_timer(on_gpu)
    per_expert = [int(r) for r in a.rows_per_expert.split(",") if r]
    rows, failures = [], []
    print(f"MoE prefill, {a.fmt} experts, D {d} I {i} top-{k}: experts | tokens | rows per expert | fused us "
          f"(rel err) | grouped us (rel err) | fused / grouped | FLOP floor us | dispatch picks", flush=True)
    for E in (int(e) for e in a.experts.split(",") if e):
        if E < k:
            ap.error(f"--experts {E} is fewer than --topk {k}")
        if a.fmt == "dense":
            g = torch.Generator(device=dev).manual_seed(0)
            w1, w3 = ((torch.randn(E, i, d, device=dev, generator=g) / d**0.5).bfloat16() for _ in range(2))
            w2, scales = (torch.randn(E, d, i, device=dev, generator=g) / i**0.5).bfloat16(), None
        else:
            w1, w3, w2, scales = _experts(E, d, i, a.fmt, dev)
        # (tokens, the rows per expert they stand for: asked, or the average they give)
        sizes = ([(tokens_for(r, E, k), r) for r in per_expert] if per_expert
                 else [(int(t), int(t) * k / E) for t in a.tokens.split(",") if t])
        for T, rpe in sizes:
            rw, idx = _routing(T, E, k, dev, seed=T)
            x = torch.randn(T, d, device=dev).bfloat16()
            want = ref.moe_experts(x, w1, w3, w2, rw, idx, 10.0, scales).float()
            cfg = quant_configs.moe_config(T, T * k, E, a.fmt)  # a config keeps moe_experts_fused on its own kernels
            fused = functools.partial(moe_experts_fused, x, w1, w3, w2, rw, idx, 10.0, scales, config=cfg)
            grouped = functools.partial(moe_experts_grouped, x, w1, w3, w2, rw, idx, 10.0, scales)
            paths = {"fused": fused, "grouped": grouped} | {
                spec: functools.partial(moe_experts_fused, x, w1, w3, w2, rw, idx, 10.0, scales, config=c)
                for spec, c in tiles.items()}
            err = {name: ((fn().float() - want).abs().max() / want.abs().max()).item() for name, fn in paths.items()}
            us = {name: timed(fn) for name, fn in paths.items()}
            t_f, t_g = us["fused"], us["grouped"]
            floor = 2 * T * k * 3 * d * i / PEAK_BF16 * 1e6
            pick = "grouped" if quant_configs.moe_grouped(T * k, E, a.fmt) else "fused"
            rows.append({"tokens": T, "experts": E, "rows_per_expert": rpe, "fmt": a.fmt, "fused_us": t_f,
                         "grouped_us": t_g, "fused_rel_err": err["fused"], "grouped_rel_err": err["grouped"],
                         "floor_us": floor, "pick": pick,
                         "tiles": {spec: {"us": us[spec], "rel_err": err[spec]} for spec in tiles}})
            extra = "".join(f" | {spec}: {us[spec]:.1f} ({err[spec]:.1e})" for spec in tiles)
            print(f"{E} | {T} | {rpe:.0f} | {t_f:.1f} ({err['fused']:.1e}) | {t_g:.1f} ({err['grouped']:.1e}) | "
                  f"{t_f / t_g:.2f} | {floor:.1f} | {pick}{extra}", flush=True)
        del w1, w3, w2, scales
        if on_gpu:
            torch.cuda.empty_cache()
    failures = [f"experts {r['experts']} tokens {r['tokens']}: {path} relative error {r[path + '_rel_err']:.3g} > 2e-2"
                for r in rows for path in ("fused", "grouped") if r[path + "_rel_err"] > 2e-2]
    failures += [f"experts {r['experts']} tokens {r['tokens']}: tile {spec} relative error {t['rel_err']:.3g} > 2e-2"
                 for r in rows for spec, t in r["tiles"].items() if t["rel_err"] > 2e-2]
    rule = fit_rule(rows)
    entry = tuple((e, None if r is None else math.ceil(r)) for e, r in rule.items())
    print(f"rule: rows per expert from which the grouped path wins, by expert count: {rule}\n"
          f"quant_configs.MOE_GROUPED_MIN_ROWS[{a.fmt!r}] = {entry}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows, "rule": {str(e): r for e, r in rule.items()}, "fmt": a.fmt, "dims": [d, i],
                       "topk": k, "device": torch.cuda.get_device_name() if on_gpu else "cpu"}, fh, indent=1)
    from tools.kernel_device import report_failures
    return report_failures("bench_moe_prefill", failures)


if __name__ == "__main__":
    sys.exit(main())
