"""Prefill's two small ops far from their floors, today's kernel against its variant (kernels/variants.py), on
random tensors of V4-Flash's shapes (64 query heads x 512, rope 64; mHC 4 streams x hidden 4096). "today" is the
kernel the variant replaces (every variant off), also where the variant is now the default (rope_tiles):

- norm + RoPE (variant rope_tiles): the query's (norm_rope), the K=V latent's into the window cache
  (kv_norm_rope_insert), both in one launch (q_kv_norm_rope, fusion q_kv_rope on), the output's inverse RoPE
  (apply_rope).
- mHC mixing (variant mix_bf16x3): the mix partials alone (kernels.fused_norm_mhc._hc_mix_partials) and hc_pre
  whole (partials + finish).

    python -m tools.bench_prefill_ops [--tokens 1,32,150,2048,8192] [--sweep-tokens 2048,8192] [--json OUT]
                                      (suite prefill_small_ops, ~2-3 minutes on the H200)

1. Check (exit 1 on a failure), on the device, per size: rope, each kernel giving the same bits twice on the
   same input, every element of the variant within a rounding of today's (one bf16 last place of itself, or
   ROW_ROUNDING of its row's RMS where a pair cancels: a row's sum of squares may be summed in another order, an
   FMA contracted another way), the worst element named (row, column, both values, the
   reference's), and the query's and latent's within bf16 tolerance of the torch reference; mix, both kernels'
   partials against the fp64 products (relative to each column's largest, <= MIX_TOL; a variant past it is
   diagnosed: which tokens and columns, and its error again under the decode tiles, one pipeline stage and PDL
   switched), and hc_pre's post / comb within MIX_TOL of today's, its collapsed row within a rounding.
2. Time, each in CUDA-graph replays (tools.kernel_device.graph_time: host overhead out; the same call replayed,
   so decode sizes run from L2 as after the op before them), against the floor: bytes / the H200's copy
   bandwidth (tools.bench_quant.H200), the mix also FLOPs / the bf16 peak.
3. Sweep at --sweep-tokens: the rope tile's rows per program (fused_rope.ROPE_TILE_ROWS, every --tokens size), and
   the mix partials' launch (fused_norm_mhc.MixTiles: token tile, K step, programs, stages) for both kernels,
   each candidate checked against the fp64 products; the fastest right one printed in the constants' form.

Without a GPU it runs under Triton's interpreter on small shapes (`--heads 2 --head-dim 64 --rope 16 --hidden 32
--tokens 1,5 --sweep-tokens 5`): the checks and the table's form, not the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time

import torch

from tools.kernel_device import gpu_or_interpreter

# how far a variant's bf16 output may part from today's at rounding alone: one bf16 last place of the element, or
# two at its row's RMS. The second is for a sum whose terms cancel (a rope pair, the streams' collapse): it can end
# near zero and flip sign on one rounding of its inputs, hundreds of last places of itself (an FMA contracted in
# one kernel and not the other does it), a rounding of the row
ROW_ROUNDING = 2.0 ** -7
MIX_TOL = 1e-5  # fp32 precision of sums over 16k products (both kernels reach ~1e-7 in the interpreter)
ROPE_ROWS = (1, 2, 4, 8, 16, 32)
TILE_KEYS = ("block_t", "block_k", "programs", "stages", "warps")  # fused_norm_mhc.MixTiles's fields


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    """(elements that differ, the largest difference in last places of bf16's 8 significant bits, of the larger
    of the two values)."""
    a, b = got.float().flatten(), want.float().flatten()
    diff = (a - b).abs()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp(min=1e-30))) - 7)
    return int((diff > 0).sum()), float((diff / ulp).max()) if diff.numel() else 0.0


@contextlib.contextmanager
def switched(variant: str | None, module=None, **constants):
    """The variant alone on (None: today's kernels), and a module's constants set, for the duration."""
    from kernels import variants

    saved = {k: getattr(module, k) for k in constants}
    try:
        variants.set_variants((variant,) if variant else ())
        for k, v in constants.items():
            setattr(module, k, v)
        yield
    finally:
        variants.set_variants(variants.DEFAULT)
        for k, v in saved.items():
            setattr(module, k, v)


def _timer(on_gpu: bool):
    if on_gpu:
        from tools.kernel_device import graph_time

        return lambda fn, calls: graph_time([fn] * calls) * 1e6

    def wall_us(fn, calls) -> float:  # the interpreter's seconds: one call after the checked one
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return wall_us


def _calls(T: int) -> int:
    """Calls a timed graph holds: enough that a replay is not a few microseconds."""
    return 100 if T <= 150 else 20 if T <= 2048 else 8


def rope_ops(T: int, heads: int, dim: int, rope: int, dev) -> dict:
    """name -> (a call returning what it wrote, its bytes, the reference's result or None)."""
    from kernels import fusions
    from kernels import reference as ref
    from kernels.fused_rope import (
        apply_rope_fused,
        kv_norm_rope_insert_fused,
        norm_rope_fused,
        q_kv_norm_rope_fused,
    )

    g = torch.Generator(device=dev).manual_seed(T)
    bf = torch.bfloat16
    q = torch.randn(T, heads, dim, device=dev, generator=g).to(bf)
    kv = torch.randn(T, dim, device=dev, generator=g).to(bf)
    w = torch.rand(dim, device=dev, generator=g) + 0.5
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, device=dev).float() / rope))
    cos, sin = ref.rope_cos_sin(torch.randint(0, 8192, (T,), device=dev, generator=g), inv, bf)
    slots = torch.randperm(2 * T, device=dev, generator=g)[:T]
    pool = torch.zeros(2 * T, 1, dim, device=dev, dtype=bf)
    trig = 2 * T * (rope // 2) * 2
    q_bytes, kv_bytes = 2 * q.numel() * 2 + trig, 2 * kv.numel() * 2 + dim * 4 + T * 8 + trig

    def insert():
        kv_norm_rope_insert_fused(kv, w, cos, sin, 1e-6, pool, slots)
        return pool

    def q_kv():
        before = fusions.enabled()
        fusions.set_fusions(before + ("q_kv_rope",))
        try:
            return q_kv_norm_rope_fused(q, kv, w, cos, sin, 1e-6, pool, slots), pool
        finally:
            fusions.set_fusions(before)

    want_kv = torch.zeros_like(pool)
    ref.kv_norm_rope_insert(kv, w, cos, sin, 1e-6, want_kv, slots)
    return {"q norm+rope": (functools.partial(norm_rope_fused, q, None, cos, sin, 1e-6), q_bytes,
                            ref.norm_rope(q, None, cos, sin, 1e-6)),
            "kv norm+rope+insert": (insert, kv_bytes, want_kv),
            "q+kv one launch": (q_kv, q_bytes + kv_bytes - trig, None),
            "inverse rope": (functools.partial(apply_rope_fused, q, cos, -sin), q_bytes, None)}


def mix_args(T: int, hc: int, hidden: int, dev) -> tuple:
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, hc, hidden, device=dev, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, hc * hidden, device=dev, generator=g) * 0.1
    base, scale = torch.randn(24, device=dev, generator=g) * 0.3, torch.rand(3, device=dev, generator=g) + 0.5
    return x, fn, base, scale


def mix_floor_us(T: int, K: int, D: int, whole: bool, hw: dict) -> float:
    """Partials: x read once, fn once, one split's 25 floats a token written; hc_pre: x read once, the collapsed
    row written; the 24 mixes' FLOPs at the bf16 peak."""
    nbytes = T * K * 2 + 24 * K * 4 + (T * D * 2 if whole else T * 25 * 4)
    return max(nbytes / hw["bytes_per_s"], 2 * T * 24 * K / hw["bf16_flops"]) * 1e6


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(r.clone() for r in (result if isinstance(result, tuple) else (result,)))


def check_and_time_rope(T, args, dev, timed, hw, failures) -> list[dict]:
    from kernels import fused_rope

    rows = []
    for name, (run, nbytes, want) in rope_ops(T, args.heads, args.head_dim, args.rope, dev).items():
        with switched(None):
            old = _outputs(run())
            old_again = _outputs(run())
            t_old = timed(run, _calls(T))
        with switched("rope_tiles"):
            new = _outputs(run())
            new_again = _outputs(run())
            t_new = timed(run, _calls(T))
        differ, steps = 0, 0.0
        for a, b in zip(new, old):
            d, s = bf16_steps(a, b)
            differ, steps = differ + d, max(steps, s)
        # which of the two moves, and by how much against its row's scale (a row's norm summed in another order
        # moves an element by a bf16 rounding; a sign flip or another row's value moves it by the row's size)
        repeat = {"today": all(torch.equal(a, b) for a, b in zip(old, old_again)),
                  "variant": all(torch.equal(a, b) for a, b in zip(new, new_again))}
        if not all(repeat.values()):
            failures.append(f"{name} T{T}: not repeatable on the same input: {repeat}")
        worst = max((worst_element(a, b, want if want is not None and want.shape == b.shape else None)
                     for a, b in zip(new, old)), key=lambda w: w["x_rounding"])
        if not worst["x_rounding"] <= 1.0:
            failures.append(f"{name} T{T}: the tiles differ from the row kernel by more than a rounding "
                            f"({steps:.0f} bf16 steps of the element; worst: {worst})")
        if want is not None:
            err = ((new[0].float() - want.float()).abs().max() / want.float().abs().max()).item()
            if not err <= 2e-2:
                failures.append(f"{name} T{T}: the tiles' relative error to the reference {err:.3g} > 2e-2")
        floor = nbytes / hw["bytes_per_s"] * 1e6
        rows.append({"op": name, "tokens": T, "today_us": t_old, "variant_us": t_new, "floor_us": floor,
                     "rows_per_program": fused_rope.tile_rows(T * (args.heads if "kv" not in name else 1)),
                     "elements_differing": differ, "max_bf16_steps": steps, "repeatable": repeat, "worst": worst})
    return rows


def worst_element(got: torch.Tensor, today: torch.Tensor, want: torch.Tensor | None) -> dict:
    """The element where the variant parts most from today's kernel in units of what rounding alone may move it
    (x_rounding: its difference over the larger of one bf16 last place of the element and ROW_ROUNDING times its
    row's RMS; above 1, more than a rounding): its index, both values, the difference over the row's RMS, and the
    reference's value (where there is one at that shape)."""
    g, t = got.float().reshape(-1, got.shape[-1]), today.float().reshape(-1, got.shape[-1])
    rms = t.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-30)
    diff = (g - t).abs()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), t.abs()).clamp(min=1e-30))) - 7)
    units = diff / torch.maximum(ulp, ROW_ROUNDING * rms)
    i = int(units.argmax())
    row, col = divmod(i, g.shape[-1])
    out = {"row": row, "col": col, "variant": g[row, col].item(), "today": t[row, col].item(),
           "x_rounding": units[row, col].item(), "diff_over_row_rms": (diff[row, col] / rms[row, 0]).item(),
           "rows_differing": int((diff > 0).any(-1).sum())}
    if want is not None:
        out["reference"] = want.float().reshape(-1, got.shape[-1])[row, col].item()
    return out


def mix_sums(part: torch.Tensor) -> torch.Tensor:
    """The split partials [splits, T, 32] summed: each token's 24 mixes and sum of squares, in fp64."""
    return part.sum(0)[:, :25].double()


@dataclasses.dataclass(frozen=True)
class MixTruth:
    """What the mix partials are checked against: the fp64 products of x and fn, and each column's largest (the
    errors are relative to it)."""

    exact: torch.Tensor
    size: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, fn: torch.Tensor) -> MixTruth:
        flat = x.double().reshape(x.shape[0], -1)
        exact = torch.cat([flat @ fn.double().T, (flat * flat).sum(-1, keepdim=True)], -1)
        return cls(exact, exact.abs().amax(0).clamp(min=1e-30))

    def rel(self, sums: torch.Tensor) -> torch.Tensor:
        return (sums - self.exact).abs() / self.size

    def err(self, sums: torch.Tensor) -> float:
        return self.rel(sums).max().item()


def check_and_time_mix(T, args, dev, timed, hw, failures) -> list[dict]:
    from kernels import reference as ref
    from kernels.fused_norm_mhc import _hc_mix_partials, hc_pre_fused

    x, fn, base, scale = mix_args(T, 4, args.hidden, dev)
    K = x[0].numel()
    truth = MixTruth.of(x, fn)
    partials = functools.partial(_hc_mix_partials, x, fn)
    whole = functools.partial(hc_pre_fused, x, fn, base, scale, 1e-6, 1e-6, 20)
    got, times = {}, {}
    for label, variant in (("today", None), ("variant", "mix_bf16x3")):
        with switched(variant):
            got[label] = (mix_sums(partials()), _outputs(whole()))
            times[label] = (timed(partials, _calls(T)), timed(whole, _calls(T)))
    err = {label: truth.err(sums) for label, (sums, _) in got.items()}
    diagnosis = None
    for label, e in err.items():
        if not e <= MIX_TOL:
            failures.append(f"mix partials T{T} {label}: relative error to fp64 {e:.3g} > {MIX_TOL}")
            if label == "variant":
                diagnosis = diagnose_mix(x, fn, truth, got["variant"][0])
                failures.append(f"mix partials T{T} variant, where: {diagnosis}")
    (post_a, comb_a, x_a), (post_b, comb_b, x_b) = got["variant"][1], got["today"][1]
    pc = max((post_a - post_b).abs().max().item(), (comb_a - comb_b).abs().max().item())
    _, steps = bf16_steps(x_a, x_b)
    worst = worst_element(x_a, x_b, None)
    if not (pc <= MIX_TOL and worst["x_rounding"] <= 1.0):
        failures.append(f"hc_pre T{T}: variant vs today post/comb {pc:.3g}, collapsed {steps:.0f} bf16 steps of "
                        f"the element (worst: {worst})")
    want = ref.hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    ref_err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1)).item()
                  for a, b in zip(got["variant"][1], want))
    if not ref_err <= 2e-2:
        failures.append(f"hc_pre T{T}: variant vs the reference {ref_err:.3g} > 2e-2")
    return [{"op": "mix partials", "tokens": T, "today_us": times["today"][0], "variant_us": times["variant"][0],
             "floor_us": mix_floor_us(T, K, args.hidden, False, hw), "today_rel_err": err["today"],
             "variant_rel_err": err["variant"], **({"variant_diagnosis": diagnosis} if diagnosis else {})},
            {"op": "hc_pre (partials + finish)", "tokens": T, "today_us": times["today"][1],
             "variant_us": times["variant"][1], "floor_us": mix_floor_us(T, K, args.hidden, True, hw),
             "post_comb_diff": pc, "max_bf16_steps": steps, "worst": worst}]


def diagnose_mix(x, fn, truth: MixTruth, got) -> dict:
    """Where the variant's partials are wrong (the worst token and column, how many tokens, whether whole token
    tiles), and its error again with the decode tiles, with one pipeline stage and with PDL switched: which of
    the launch, the pipelined loads or the programmatic launch moves it."""
    from kernels import fused_norm_mhc, pdl
    from kernels.fused_norm_mhc import MIX_PIECES_TILES, MixTiles, _hc_mix_partials

    rel = truth.rel(got)
    bad = rel > MIX_TOL
    t, c = divmod(int(rel.argmax()), rel.shape[1])
    tiles = MIX_PIECES_TILES["prefill" if x.shape[0] >= fused_norm_mhc.MIX_WIDE_T else "decode"]
    bad_tokens = bad.any(-1).nonzero().flatten()
    out = {"token": t, "column": c, "got": got[t, c].item(), "want": truth.exact[t, c].item(),
           "tokens_wrong": len(bad_tokens), "token_tiles_wrong": len({int(i) // tiles.block_t for i in bad_tokens}),
           "columns_wrong": bad.any(0).nonzero().flatten().tolist()}

    def again(tiles_used: MixTiles | None = None) -> float:
        with switched("mix_bf16x3"):
            return truth.err(mix_sums(_hc_mix_partials(x, fn, tiles_used)))

    out["rel_err_decode_tiles"] = again(MIX_PIECES_TILES["decode"])
    out["rel_err_one_stage"] = again(dataclasses.replace(tiles, stages=1))
    before = pdl.enabled()
    pdl.set_enabled(not before)
    try:
        out[f"rel_err_pdl_{'off' if before else 'on'}"] = again()
    finally:
        pdl.set_enabled(before)
    return out


def sweep_rope_rows(tokens, args, dev, timed) -> list[dict]:
    """q norm + RoPE at each rows-per-program, every size (the rule's floor on programs off)."""
    from kernels import fused_rope

    out = []
    for T in tokens:
        run = rope_ops(T, args.heads, args.head_dim, args.rope, dev)["q norm+rope"][0]
        for rows in ROPE_ROWS:
            with switched("rope_tiles", fused_rope, ROPE_TILE_ROWS=rows, ROPE_TILE_PROGRAMS=1):
                out.append({"tokens": T, "rows": rows, "us": timed(run, _calls(T))})
    return out


def mix_candidates(sms: int):
    from kernels.fused_norm_mhc import MixTiles

    return [MixTiles(bt, bk, p * sms, st, 8 if bt >= 128 else 4) for bt in (64, 128) for bk in (128, 256)
            for p in (1, 2, 4) for st in (1, 2, 3, 4)]


def sweep_mix(tokens, args, dev, timed) -> list[dict]:
    """The mix partials at each MixTiles candidate, both kernels, each checked against the fp64 products
    (rel_err; the tiles should change only the order of fp32 sums). A candidate that cannot launch (shared
    memory) is recorded with its error, not timed."""
    from kernels import quant_configs
    from kernels.fused_norm_mhc import _hc_mix_partials

    out = []
    for T in tokens:
        x, fn, _, _ = mix_args(T, 4, args.hidden, dev)
        truth = MixTruth.of(x, fn)
        for label, variant in (("today", None), ("variant", "mix_bf16x3")):
            for tiles in mix_candidates(quant_configs.SMS):
                row = {"tokens": T, "kernel": label, **dataclasses.asdict(tiles)}
                try:
                    with switched(variant):
                        call = functools.partial(_hc_mix_partials, x, fn, tiles)
                        row["rel_err"] = truth.err(mix_sums(call()))
                        row["us"] = timed(call, _calls(T))
                except Exception as e:  # out of shared memory, say: named, and the rest runs
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                out.append(row)
    return out


def best_tiles(sweep: list[dict]) -> dict:
    """Per kernel: the candidate with the least time summed over the swept sizes, among those timed and right
    (within MIX_TOL of the fp64 products) at every one."""
    sizes = {r["tokens"] for r in sweep}
    best = {}
    for kernel in sorted({r["kernel"] for r in sweep}):
        totals: dict[tuple, list[float]] = {}
        for r in sweep:
            if r["kernel"] == kernel and "us" in r and r.get("rel_err", 0.0) <= MIX_TOL:
                totals.setdefault(tuple(r[k] for k in TILE_KEYS), []).append(r["us"])
        complete = {k: sum(v) for k, v in totals.items() if len(v) == len(sizes)}
        if complete:
            k = min(complete, key=complete.get)
            best[kernel] = {**dict(zip(TILE_KEYS, k)), "total_us": complete[k]}
    return best


def table(rows: list[dict]) -> str:
    lines = ["| op | tokens | today us (x floor) | variant us (x floor) | floor us | today / variant | check |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        f = r["floor_us"]
        check = (f"{r['elements_differing']} differ, <= {r['max_bf16_steps']:.0f} bf16 step" if "elements_differing"
                 in r else f"rel err {r['today_rel_err']:.1e} / {r['variant_rel_err']:.1e}" if "today_rel_err" in r
                 else f"post/comb {r['post_comb_diff']:.1e}, x <= {r['max_bf16_steps']:.0f} step")
        lines.append(f"| {r['op']} | {r['tokens']} | {r['today_us']:.1f} ({r['today_us'] / f:.1f}x) | "
                     f"{r['variant_us']:.1f} ({r['variant_us'] / f:.1f}x) | {f:.1f} | "
                     f"{r['today_us'] / r['variant_us']:.2f} | {check} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_prefill_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,32,150,2048,8192")
    ap.add_argument("--sweep-tokens", default="2048,8192", help="sizes the launch sweeps run at (empty: none)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = gpu_or_interpreter()  # before the kernels' modules load
    on_gpu = dev.type == "cuda"
    from kernels import fused_norm_mhc, fused_rope
    from tools.bench_quant import H200

    timed, start = _timer(on_gpu), time.perf_counter()
    tokens = [int(t) for t in args.tokens.split(",") if t]
    sweep_tokens = [int(t) for t in args.sweep_tokens.split(",") if t]
    rows, failures = [], []
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "hw": H200, "rows": rows,
              "failures": failures, "shapes": {"heads": args.heads, "head_dim": args.head_dim, "rope": args.rope,
                                               "hc": 4, "hidden": args.hidden}}

    def save():
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)

    for T in tokens:
        rows += check_and_time_rope(T, args, dev, timed, H200, failures)
        rows += check_and_time_mix(T, args, dev, timed, H200, failures)
        print(f"  T {T}: {len(rows)} rows ({time.perf_counter() - start:.1f} s)", flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
        save()
    print(table(rows), flush=True)
    if sweep_tokens:
        result["rope_rows_sweep"] = sweep_rope_rows(tokens, args, dev, timed)
        result["mix_sweep"] = sweep_mix(sweep_tokens, args, dev, timed)
        by_size = {T: min((r for r in result["rope_rows_sweep"] if r["tokens"] == T), key=lambda r: r["us"])
                   for T in tokens}
        result["best"] = {"rope_rows": {str(T): r["rows"] for T, r in by_size.items()},
                          "mix": best_tiles(result["mix_sweep"])}
        print("rope rows per program, fastest per size (today's rule in brackets): "
              + ", ".join(f"T {T}: {r['rows']} ({r['us']:.1f} us) [{fused_rope.tile_rows(T * args.heads)}]"
                          for T, r in by_size.items()), flush=True)
        for kernel, b in result["best"]["mix"].items():
            table_name = "MIX_PIECES_TILES" if kernel == "variant" else "MIX_TILES"
            now = (fused_norm_mhc.MIX_PIECES_TILES if kernel == "variant" else fused_norm_mhc.MIX_TILES)["prefill"]
            print(f"mix partials ({kernel}), fastest over T {sweep_tokens}: {table_name}['prefill'] = MixTiles("
                  f"{b['block_t']}, {b['block_k']}, {b['programs']}, {b['stages']}, {b['warps']})  "
                  f"[{b['total_us']:.1f} us summed; now {now}]", flush=True)
        save()
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    from tools.kernel_device import report_failures
    return report_failures("bench_prefill_ops", failures)


if __name__ == "__main__":
    sys.exit(main())
