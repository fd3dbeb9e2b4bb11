"""The bf16 GEMV (kernel variant bf16_gemv, kernels/bf16_gemv.py) against cuBLAS at decode's rows, on V4-Flash's bf16
linears (from the flash-shaped preset: a CSA layer's stacked readers of the attention input, an HCA layer's, the
indexer's wq_b, the MoE router's gate at 16 and 256 experts): each checked against float64 (within a bf16 rounding), each timed as 20 calls in one CUDA graph
(the GEMV's PDL overlap between calls included, as in a decode step), next to the bytes' floor. Prints a table,
writes JSON rows.

    python -m tools.bench_bf16_gemv [--rows 1,2,4,8] [--json out.json]

Without a GPU it runs under Triton's interpreter on the CPU on a scaled-down shape (`--shapes 48x256`): the
arithmetic and the table, not the timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from tools.kernel_device import call_timer, gpu_or_interpreter

BYTES_PER_S = 4.2e12  # the H200's copy bandwidth (docs/PERF.md's machines): the floor's divisor


def v4_flash_shapes() -> dict[str, tuple[int, int]]:
    """name -> (N, K) of V4-Flash's bf16 linears at decode (the LM head, ~1 GB, is not the variant's)."""
    from engine.models.deepseek_v4.random_checkpoint import PRESETS
    c = PRESETS["flash-shaped"]
    D, hd, ihd = c["hidden_size"], c["head_dim"], c["index_head_dim"]
    return {"csa_x_readers": (2 * 2 * hd + 2 * 2 * ihd + c["index_n_heads"], D),  # compressor + indexer's, overlapped
            "hca_x_readers": (2 * hd, D), "indexer_wq_b": (c["index_n_heads"] * ihd, c["q_lora_rank"]),
            # the MoE router's gate (kernels/fused_gate.py) at the depth suites' 16 experts and the model's 256
            "router_gate_e16": (16, D), "router_gate_e256": (256, D)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_bf16_gemv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--shapes", default="", help="NxK,... instead of V4-Flash's (e.g. 48x256 on the CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = gpu_or_interpreter()  # before the kernels' modules load
    from kernels.bf16_gemv import bf16_gemv

    shapes = ({s: tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")} if a.shapes
              else v4_flash_shapes())
    timed = call_timer(dev.type == "cuda", calls=20)
    print("bf16 linear | N x K | rows | cuBLAS us | GEMV us | cuBLAS / GEMV | bytes floor us | GEMV err / bound",
          flush=True)
    rows_out, failures = [], []
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).bfloat16()
        for m in (int(r) for r in a.rows.split(",") if r):
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            exact = x.double() @ w.double().T
            # one rounding to bf16 (the interpreter truncates: 2^-7) plus float32 sums (K 2^-24 of the terms)
            bound = 2**-7 * exact.abs() + k * 2**-24 * (x.double().abs() @ w.double().abs().T)
            got = bf16_gemv(x, w)
            worst = ((got.double() - exact).abs() / bound).max().item()
            cublas = functools.partial(torch.nn.functional.linear, x, w)
            gemv = functools.partial(bf16_gemv, x, w)
            t_c, t_g = timed(cublas), timed(gemv)
            floor = (n * k + m * (n + k)) * 2 / BYTES_PER_S * 1e6
            rows_out.append({"linear": name, "n": n, "k": k, "rows": m, "cublas_us": t_c, "gemv_us": t_g,
                             "floor_us": floor, "err_over_bound": worst})
            print(f"{name} | {n} x {k} | {m} | {t_c:.1f} | {t_g:.1f} | {t_c / t_g:.2f} | {floor:.1f} | {worst:.2f}",
                  flush=True)
            if worst > 1:
                failures.append(f"{name} rows {m}: GEMV error {worst:.2f}x its bound")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows_out, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"},
                      fh, indent=1)
    from tools.kernel_device import report_failures
    return report_failures("bench_bf16_gemv", failures)


if __name__ == "__main__":
    sys.exit(main())
