"""Does keeping an FP8 linear as stored pay? The engine's own dispatch of each FP8 linear
(kernels.fused.fp8 -> kernels/quant_configs.py's tiles, 128x128 V4 or 32x32 V4.1 scale blocks)
against cuBLAS on the same weight dequantized to bf16 at load, at decode and prefill row counts,
timed in CUDA-graph replays over weight copies the L2 cannot hold; for V4's blocks also cuBLAS's
own blockwise FP8 GEMM (the engine's "cublas" variant: act quant + torch's scaled_mm), checked against the act-quant
reference, and where the dispatch picks it, the "mma" kernel it replaces. Prints a table, writes JSON.

    python -m tools.bench_fp8_vs_bf16 [--rows 1,32,1024,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from tools.bench_quant import (
    LINEAR_SHAPES,
    ROTATE_BYTES,
    V41_BLOCK,
    V41_LINEAR_SHAPES,
    _fp8_weight,
    cdiv,
)
from tools.kernel_device import graph_time


def blockwise_cublas(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """cuBLAS's blockwise FP8 GEMM as the engine runs it (kernels/fused_fp8_linear.py's "cublas" variant, asked for
    by name at any row count: the act-quant kernel, then torch's scaled_mm; V4's blocks only). -> (a call, its
    output) or (None, why not)."""
    from kernels.fused_fp8_linear import fp8_linear_fused

    call = functools.partial(fp8_linear_fused, x, q, s, "cublas")
    try:
        return call, call()
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def time_pair(m: int, n: int, k: int, block: int, device) -> dict:
    from kernels import reference as ref
    from kernels.fused_fp8_linear import fp8_linear_fused, tiles

    q, s = _fp8_weight(n, k, device, block=block)
    w = ref.dequantize(q, s, torch.bfloat16)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    copies = max(1, min(64, cdiv(int(ROTATE_BYTES), n * k)))
    fp8s = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
    bf16s = [w] + [w.clone() for _ in range(max(1, copies // 2) - 1)]  # bf16 is twice the bytes per copy
    err = (fp8_linear_fused(x, q, s).float() - torch.nn.functional.linear(x, w).float()).abs().max().item()
    t_fp8 = graph_time([functools.partial(fp8_linear_fused, x, wq, ws) for wq, ws in fp8s])
    t_bf16 = graph_time([functools.partial(torch.nn.functional.linear, x, wb) for wb in bf16s])
    extra = {}
    variant, cfg = tiles(m, n, k, block=block)
    if variant == "cublas":  # the kernel the engine's dispatch replaces, timed
        extra["mma_us"] = graph_time([functools.partial(fp8_linear_fused, x, wq, ws, "mma") for wq, ws in fp8s]) * 1e6
    if block == 128:  # cuBLAS's own FP8 GEMM on the stored weight, against the act-quant reference
        call, got = blockwise_cublas(x, q, s)
        if call is None:
            extra["cublas_fp8_error"] = got
        else:
            want = ref.linear_act_quant(x, q, s).float()
            extra["cublas_fp8_rel_err"] = ((got.float() - want).abs().max() / want.abs().max()).item()
            extra["cublas_fp8_us"] = graph_time([call]) * 1e6
    return {"rows": m, "n": n, "k": k, "block": block, "fp8_us": t_fp8 * 1e6, "bf16_us": t_bf16 * 1e6,
            "fp8_over_bf16": t_fp8 / t_bf16, "variant": variant, "config": cfg, "max_abs_diff": err, **extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_fp8_vs_bf16", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,1024,4096")
    ap.add_argument("--only", choices=("v4", "v41"), default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the timings are CUDA-graph replays)", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    sets = [("v41", V41_LINEAR_SHAPES, V41_BLOCK), ("v4", LINEAR_SHAPES, 128)]
    rows = [int(r) for r in a.rows.split(",") if r]
    out = []
    print("model | linear | rows | FP8 as stored us (variant) | bf16 cuBLAS us | FP8 / bf16 | cuBLAS FP8 "
          "blockwise us (act quant included, rel err)", flush=True)
    for model, shapes, block in sets:
        if a.only and model != a.only:
            continue
        for m in rows:
            for name, (n, k) in shapes.items():
                r = {"model": model, "name": name, **time_pair(m, n, k, block, device)}
                out.append(r)
                blockwise = (f"{r['cublas_fp8_us']:.1f} ({r['cublas_fp8_rel_err']:.1e})" if "cublas_fp8_us" in r
                             else r.get("cublas_fp8_error", "-"))
                mma = f" | mma {r['mma_us']:.1f} us" if "mma_us" in r else ""
                print(f"{model} | {name} {n}x{k} | {m} | {r['fp8_us']:.1f} ({r['variant']}) | {r['bf16_us']:.1f} | "
                      f"{r['fp8_over_bf16']:.2f} | {blockwise}{mma}", flush=True)
    for model in ("v4", "v41"):
        for m in rows:
            sel = [r for r in out if r["model"] == model and r["rows"] == m]
            if sel:
                f, b = sum(r["fp8_us"] for r in sel), sum(r["bf16_us"] for r in sel)
                print(f"{model} all linears at {m} rows: FP8 {f:.1f} us vs bf16 {b:.1f} us -> {f / b:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
