"""The MXFP4 experts' unpack to bf16 (kernels/mxfp4_unpack.py, the first pass of the prefill MoE's grouped path,
kernels/moe_grouped.py): how close to its memory floor is it, and which tile is fastest?

The unpack reads every stored byte once (e2m1 pairs and ue8m0 scales) and writes two bytes per weight, so its
floor is those bytes at the copy bandwidth measured here. At V4-Flash depth it runs once per layer and
prefill call for gate, up and down (a 4 x 1024-token prefill at 16 experts: 22.8 ms of 291 ms in the
profile, about twice those bytes), a fixed cost a one-user TTFT pays whole.

    python -m tools.bench_unpack [--experts 16] [--dims 4096,2048] [--json OUT]   (suite prefill_unpack, ~1 min)

The table's tile checked equal, bit for bit, to kernels.formats' dequantizer first; then per candidate tile
(rows, K columns, warps) its output checked equal to the table's (each weight is decoded alone: the tile
changes nothing but the launch), then timed in CUDA-graph replays over the
three matrices of one layer (gate and up [E, I, D], down [E, D, I]). Prints each against the floor and the
fastest in UNPACK_TILES' form; writes JSON {"copy_TB_s", "rows", "best"}; exit 1 if a candidate's output
differs. Without a GPU it runs under Triton's interpreter on small shapes (`--experts 2 --dims 256,128`):
the check and the table's form, not the timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from tools.kernel_device import gpu_or_interpreter


def candidates():
    from kernels.mxfp4_unpack import UnpackTiles

    return [UnpackTiles(n, k, w) for n in (16, 32, 64, 128) for k in (128, 256, 512) for w in (4, 8)
            if n * k <= 32768]


def layer_weights(E: int, D: int, I: int, dev) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random stored experts of one layer: gate and up [E, I, D/2], down [E, D, I/2], with ue8m0 scales
    around 2^-7 (every e2m1 code, both signs)."""
    g = torch.Generator(device=dev).manual_seed(E * D + I)
    out = []
    for n, k in ((I, D), (I, D), (D, I)):
        w = torch.randint(-128, 128, (E, n, k // 2), device=dev, generator=g, dtype=torch.int8)
        s = torch.randint(115, 125, (E, n, k // 32), device=dev, generator=g, dtype=torch.uint8)
        out.append((w, s))
    return out


def layer_bytes(weights) -> int:
    """Read (stored bytes and scales) + written (bf16) bytes of unpacking them all."""
    return sum(w.numel() + s.numel() + 2 * 2 * w.numel() for w, s in weights)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_unpack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dims", default="4096,2048", help="D (hidden), I (expert width)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = gpu_or_interpreter()  # before the kernels' modules load
    on_gpu = dev.type == "cuda"
    from kernels import mxfp4_unpack
    from kernels.formats import dequantize_mxfp4
    from kernels.mxfp4_unpack import mxfp4_unpacked

    D, I = (int(v) for v in args.dims.split(","))
    weights = layer_weights(args.experts, D, I, dev)
    nbytes = layer_bytes(weights)
    if on_gpu:
        from tools.bench_engine import copy_bandwidth
        from tools.kernel_device import graph_time

        bw = copy_bandwidth()
    else:
        bw = None
    table = mxfp4_unpack.UNPACK_TILES
    want = [mxfp4_unpacked(w, s) for w, s in weights]  # the table's tile, its K step fitted to each matrix
    rows, failures, start = [], [], time.perf_counter()
    for (w, s), out in zip(weights, want):  # the table's tile against the formats' dequantizer, first
        if not torch.equal(out, dequantize_mxfp4(w, s).to(torch.bfloat16)):
            failures.append(f"tiles {table}: output differs from kernels.formats.dequantize_mxfp4's")
    for tiles in candidates():
        row = dataclasses.asdict(tiles)
        if min(D, I) % tiles.block_k:
            continue
        try:
            got = [mxfp4_unpacked(w, s, tiles) for w, s in weights]
            row["equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
            del got
            if not row["equal"]:
                failures.append(f"tiles {tiles}: output differs from {table}'s")
            if on_gpu:
                calls = [lambda w=w, s=s, t=tiles: mxfp4_unpacked(w, s, t) for w, s in weights]
                row["us"] = graph_time(calls) * len(calls) * 1e6  # the layer's matrices, all
                row["TB_s"] = nbytes / row["us"] / 1e6
                row["x_floor"] = row["us"] / (nbytes / bw * 1e6)
        except Exception as e:  # a tile that cannot launch is recorded, the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
        print(f"  {tiles}: " + (f"{row['us']:.1f} us, {row['TB_s']:.2f} TB/s, {row['x_floor']:.2f}x floor"
                                if "us" in row else row.get("error", "equal" if row.get("equal") else "DIFFERS")),
              flush=True)
    timed = [r for r in rows if "us" in r and r["equal"]]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    now = next((r for r in rows if (r["block_n"], r["block_k"], r["warps"]) ==
                (table.block_n, table.block_k, table.warps or 4)), None)
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "experts": args.experts, "D": D, "I": I,
              "layer_bytes": nbytes, "copy_TB_s": bw / 1e12 if bw else None, "rows": rows, "best": best,
              "table": dataclasses.asdict(table), "failures": failures}
    if best:
        print(f"one layer's unpack ({args.experts} experts, D {D}, I {I}: {nbytes / 1e9:.2f} GB moved, floor "
              f"{nbytes / bw * 1e6:.1f} us at {bw / 1e12:.2f} TB/s): fastest UNPACK_TILES = UnpackTiles("
              f"{best['block_n']}, {best['block_k']}, {best['warps']})  [{best['us']:.1f} us, {best['x_floor']:.2f}x"
              f" floor; now {table}" + (f": {now['us']:.1f} us, {now['x_floor']:.2f}x]" if now and "us" in now
                                         else "]"), flush=True)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    from tools.kernel_device import report_failures
    return report_failures("bench_unpack", failures)


if __name__ == "__main__":
    sys.exit(main())
