"""The quantized kernels on CUDA: checked against their torch references, then timed against floors.

    python -m tools.bench_quant [--json OUT/quant.json] [--quick]    (tools/h200_bench.sh quant)

1. Check (fails the run, exit 1): the block-scaled FP8 linear, both variants (the "mma" one on the
   FP8 tensor cores), and the fused MoE on MXFP4 and FP8 experts, vs kernels/reference.py.
2. Time (CUDA events, triton.testing.do_bench) V4-Flash shapes at decode (1, 32, 150 rows) and
   prefill (2048, 8192 tokens): each FP8 dense linear in both variants, the MXFP4 MoE (256
   experts, top-6), and FP8 experts at decode. Floors on the H200: bytes / 4.2 TB/s and
   FLOPs / peak (790 TFLOP/s bf16; the FP8 MMA twice that). JSON: every row, the measured
   "crossover" (rows up to which "dequant" wins, per weight shape: kernels/fused_fp8_linear.py's
   DEQUANT_MAX_ROWS) and any failure. The table prints last.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

H200 = {"bytes_per_s": 4.2e12, "bf16_flops": 790e12, "fp8_flops": 2 * 790e12}
DECODE_ROWS = (1, 32, 150)
PREFILL_ROWS = (2048, 8192)
# V4-Flash's FP8 dense linears, (N, K): attention projections and the shared expert
LINEAR_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared_w1": (2048, 4096)}
MOE_SHAPE = {"D": 4096, "I": 2048, "E": 256, "k": 6}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_floor(m: int, n: int, k: int, variant: str, hw: dict = H200) -> dict:
    """Bytes: FP8 weight + float32 block scales + bf16 activations in and out. FLOPs at the bf16 peak
    (dequant: bf16 MMA) or the FP8 peak (mma)."""
    nbytes = n * k + cdiv(n, 128) * cdiv(k, 128) * 4 + 2 * m * k + 2 * m * n
    flops = 2 * m * n * k
    mem_s = nbytes / hw["bytes_per_s"]
    flop_s = flops / hw["fp8_flops" if variant == "mma" else "bf16_flops"]
    return {"bytes": nbytes, "flops": flops, "mem_s": mem_s, "flop_s": flop_s, "floor_s": max(mem_s, flop_s)}


def expert_bytes(D: int, I: int, fmt: str) -> float:
    """One expert's w1, w3, w2 as stored, scales included."""
    n = 3 * I * D
    return n * (0.5 + 1 / 32) if fmt == "mxfp4" else n * (1 + 4 / (128 * 128))


def moe_floor(rows: int, experts_hit: int, D: int, I: int, k: int, fmt: str, hw: dict = H200) -> dict:
    """Bytes: the experts the batch hits + bf16 x in, y out and h written and read back. FLOPs at
    the bf16 peak (the weight tiles are dequantized to bf16 for the MMA)."""
    nbytes = experts_hit * expert_bytes(D, I, fmt) + 2 * rows * D * 2 + 2 * rows * k * I * 2
    flops = 2 * rows * k * 3 * I * D
    mem_s, flop_s = nbytes / hw["bytes_per_s"], flops / hw["bf16_flops"]
    return {"bytes": nbytes, "flops": flops, "mem_s": mem_s, "flop_s": flop_s, "floor_s": max(mem_s, flop_s)}


def cases(quick: bool = False) -> list[dict]:
    """Every timed row: FP8 linears (both variants) and MoE (mxfp4 at all rows, fp8 experts at decode)."""
    rows = DECODE_ROWS + (PREFILL_ROWS[:1] if quick else PREFILL_ROWS)
    shapes = dict(list(LINEAR_SHAPES.items())[:2]) if quick else LINEAR_SHAPES
    out = [{"op": "fp8_linear", "name": name, "rows": m, "n": n, "k": k, "variant": v}
           for name, (n, k) in shapes.items() for m in rows for v in ("dequant", "mma")]
    out += [{"op": "moe", "name": "experts", "rows": m, "fmt": "mxfp4", **MOE_SHAPE} for m in rows]
    out += [{"op": "moe", "name": "experts", "rows": m, "fmt": "fp8", **MOE_SHAPE} for m in DECODE_ROWS]
    return out


def crossover(results: list[dict]) -> dict:
    """Per (N, K): the largest row count at which "dequant" is at least as fast as "mma"
    (0: mma always wins)."""
    by = {}
    for r in results:
        if r["op"] == "fp8_linear" and "seconds" in r:
            by.setdefault((r["n"], r["k"]), {}).setdefault(r["rows"], {})[r["variant"]] = r["seconds"]
    out = {}
    for (n, k), rows in by.items():
        wins = [m for m, t in rows.items() if len(t) == 2 and t["dequant"] <= t["mma"]]
        out[f"{n}x{k}"] = max(wins, default=0)
    return out


def table(results: list[dict]) -> str:
    lines = [f"{'op':<11}{'shape':<22}{'rows':>6}  {'variant':<8}{'us':>9}{'floor us':>10}{'of floor':>9}{'TB/s':>7}{'TFLOP/s':>9}"]
    for r in results:
        shape = f"{r['name']} {r['n']}x{r['k']}" if r["op"] == "fp8_linear" else f"E{r['E']} D{r['D']} I{r['I']} k{r['k']}"
        variant = r.get("variant", r.get("fmt"))
        if "seconds" not in r:
            lines.append(f"{r['op']:<11}{shape:<22}{r['rows']:>6}  {variant:<8}  {r.get('error', 'not run')[:40]}")
            continue
        t, f = r["seconds"], r["floor"]
        lines.append(f"{r['op']:<11}{shape:<22}{r['rows']:>6}  {variant:<8}{t * 1e6:>9.1f}{f['floor_s'] * 1e6:>10.1f}"
                     f"{f['floor_s'] / t:>9.2f}{f['bytes'] / t / 1e12:>7.2f}{f['flops'] / t / 1e12:>9.1f}")
    return "\n".join(lines)


def _fp8_weight(n: int, k: int, device, ue8m0: bool = True, seed: int = 0):
    from kernels.formats import quantize_fp8_block, scale_to_float

    g = torch.Generator(device=device).manual_seed(seed)
    q, s = quantize_fp8_block(torch.randn(n, k, device=device, generator=g) / k**0.5, ue8m0=ue8m0)
    return q, scale_to_float(s)


@functools.lru_cache(maxsize=4)
def _experts(E: int, D: int, I: int, fmt: str, device, seed: int = 0):
    """(w1, w3, w2, scales) in a stored format, scales as the loader hands them to the kernels;
    quantized one expert at a time (the quantizers' temporaries are 8x the weight)."""
    from kernels.formats import quantize_fp8_block, quantize_mxfp4, scale_to_float

    g = torch.Generator(device=device).manual_seed(seed)
    ws, ss = [], []
    for n, k in ((I, D), (I, D), (D, I)):
        parts = []
        for _ in range(E):
            w = torch.randn(n, k, device=device, generator=g) / k**0.5
            if fmt == "mxfp4":
                q, s = quantize_mxfp4(w)
                parts.append((q, s.view(torch.uint8)))
            else:
                q, s = quantize_fp8_block(w, ue8m0=False)
                parts.append((q, scale_to_float(s)))
        ws.append(torch.stack([q for q, _ in parts]))
        ss.append(torch.stack([s for _, s in parts]))
    return ws[0], ws[1], ws[2], tuple(ss)


def _routing(T: int, E: int, k: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(T, E, device=device, generator=g).argsort(dim=-1)[:, :k]
    return torch.rand(T, k, device=device, generator=g).to(torch.bfloat16), idx


def check(device) -> list[str]:
    """Kernels vs references on awkward shapes; the failures, named (empty: all agree)."""
    from kernels import reference as ref
    from kernels.fused_fp8_linear import fp8_linear_fused
    from kernels.fused_moe import moe_experts_fused

    failures = []
    for m, n, k in ((1, 256, 512), (33, 200, 300), (150, 384, 1024)):
        q, s = _fp8_weight(n, k, device, seed=m)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        want, want_q = ref.linear(x, q, s).float(), ref.linear_act_quant(x, q, s).float()
        scale = want.abs().max().item()
        for variant, target, tol in (("dequant", want, 1e-2), ("mma", want_q, 1e-2), ("mma", want, 0.1)):
            err = (fp8_linear_fused(x, q, s, variant=variant).float() - target).abs().max().item()
            if not err <= tol * scale:  # `not <=` also catches NaN
                failures.append(f"fp8_linear {variant} {m}x{n}x{k}: max error {err:.3g} > {tol} x {scale:.3g}")
    for fmt in ("mxfp4", "fp8"):
        for T, D, I, E, k in ((1, 256, 128, 8, 2), (40, 384, 256, 6, 6)):
            w1, w3, w2, scales = _experts(E, D, I, fmt, device, seed=T)
            x = torch.randn(T, D, device=device).to(torch.bfloat16)
            w, idx = _routing(T, E, k, device, seed=T)
            want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales).float()
            err = (moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales).float() - want).abs().max().item()
            scale = max(want.abs().max().item(), 1.0)
            if not err <= 3e-2 * scale:
                failures.append(f"moe {fmt} T{T} D{D} I{I} E{E} k{k}: max error {err:.3g} > 3e-2 x {scale:.3g}")
    return failures


def _time(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e-3


def measure(case: dict, device) -> dict:
    from kernels.fused_fp8_linear import fp8_linear_fused
    from kernels.fused_moe import moe_experts_fused

    m = case["rows"]
    if case["op"] == "fp8_linear":
        n, k = case["n"], case["k"]
        q, s = _fp8_weight(n, k, device)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        t = _time(lambda: fp8_linear_fused(x, q, s, variant=case["variant"]))
        return {**case, "seconds": t, "floor": linear_floor(m, n, k, case["variant"])}
    D, I, E, k = case["D"], case["I"], case["E"], case["k"]
    w1, w3, w2, scales = _experts(E, D, I, case["fmt"], device)
    x = torch.randn(m, D, device=device).to(torch.bfloat16)
    w, idx = _routing(m, E, k, device, seed=m)
    hit = int(torch.unique(idx).numel())
    t = _time(lambda: moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales))
    return {**case, "experts_hit": hit, "seconds": t, "floor": moe_floor(m, hit, D, I, k, case["fmt"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="two linear shapes, one prefill size")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    start = time.perf_counter()
    failures = check(device)
    print(f"check: {'OK' if not failures else 'FAILED'} ({time.perf_counter() - start:.1f} s)", flush=True)
    for f in failures:
        print("  MISMATCH", f, flush=True)
    results = []
    for case in cases(args.quick):
        try:
            results.append(measure(case, device))
        except Exception as e:  # record, keep going, fail at the end
            results.append({**case, "error": f"{type(e).__name__}: {e}"})
            failures.append(f"{case['op']} {case['name']} rows {case['rows']}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
        report = {"device": torch.cuda.get_device_name(), "hw": H200, "failures": failures,
                  "crossover": crossover(results), "results": results, "seconds": time.perf_counter() - start}
        if args.json:  # after every row: a run cut short by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    print(f"crossover (rows where dequant still wins, per NxK): {report['crossover']}")
    print(table(results))
    if failures:
        print(f"bench_quant: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
