"""The fused kernels on CUDA: each checked against its torch reference (exit 1 on a
mismatch), then timed against its memory floor and against the path it replaces.

    python -m tools.bench_fused [--json OUT/fused.json] [--only fp8 ...]   (suite kernels_fused, ~3 minutes;
    suite kernels_fp8: the check and the FP8 linear rows only)

Rows (V4-Flash decode shapes at the depth-43 benchmark's 16 experts, batch 1 / 32 / 150):
- moe_align: the one-launch MoE row alignment vs the torch ops it replaced (kernels.reference.moe_align).
- moe mxfp4 / fp8: the engine's MoE tiles (quant_configs.moe_config: the row tile per step, split-K
  at few rows, MXFP4 through the integer "bf16" decode) vs the former 16-row tiles without split-K
  (MXFP4 through the e4m3 placement), and MXFP4's "bf16-parts" decode on the engine's tiles.
- fp8 linear: the decode GEMV with its split-K reduced in the kernel (was a second reduce kernel),
  V4-Flash's dense shapes vs floor, with each e4m3 -> bf16 conversion (W_CVT: "cast" the old one,
  "f32", "int" the default) where the shape's config is the dequant GEMV, and at 1 row the CUDA-core
  "gemv" variant (GEMV_CONFIGS, not dispatched until measured faster); wo_a's 8 groups in one
  launch vs one call per group (the old path); the stacked pairs (engine/models/stacked_linears.py: wq_a
  over wkv, the shared expert's w1 over w3) in one launch vs two.
- mega-gate: the router in one launch (GEMM + sqrt-softplus + bias + top-k + renormalise) vs the
  reference (cuBLAS GEMM + torch ops; the depth profile's previous path was cuBLAS split-K GEMM +
  its reduce + one router kernel, ~8 us per layer at batch 1); a hash layer (tid2eid) as well.
- mega-mHC: hc_post + the next hc_pre + its RMSNorm in two launches vs the three fused ops (four launches).
- compress: the compressors' multi-row step (prefill chunk, speculative verify) fused vs its torch ops
  (tools/bench_compress.py).
Times: CUDA-graph replay (tools.kernel_device.graph_time, host overhead out). Floor = bytes / 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tools import bench_compress
from tools.bench_quant import H200, _experts, _rel_err, _routing, moe_floor
from tools.kernel_device import exit_status, graph_time

ROWS = (1, 32, 150)
DEPTH_MOE = {"D": 4096, "I": 2048, "E": 16, "k": 6}


def _moe_cfg(rows: int, fmt: str, experts: int, k: int, **over) -> dict:
    from kernels import quant_configs

    cfg = quant_configs.moe_config(rows, rows * k, experts, fmt)["gate_up"]
    cfg = {**cfg, **over}
    return {"gate_up": cfg, "down": cfg}


def check(device) -> list[str]:
    """The new kernels vs their references on small awkward shapes; the failures, named."""
    from kernels import reference as ref
    from kernels.fused_moe import moe_experts_fused
    from kernels.fused_moe_align import moe_align_fused

    failures = []
    for T, E, k, bm in ((1, 16, 6, 16), (150, 16, 6, 128), (150, 256, 6, 16), (2048, 256, 6, 64)):
        _, idx = _routing(T, E, k, device, seed=T)
        got, want = moe_align_fused(idx, E, bm), ref.moe_align(idx, E, bm)
        same = all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
        sorted_ok = torch.equal(idx.reshape(-1)[got[0].long()].sort().values, idx.reshape(-1).sort().values) and \
            torch.equal(got[0].long().sort().values, torch.arange(T * k, device=device))
        grouped = torch.equal(idx.reshape(-1)[got[0].long()], idx.reshape(-1)[want[0].long()])
        if not (same and sorted_ok and grouped):
            failures.append(f"moe_align T{T} E{E} k{k} block_m {bm}: tiles {same}, permutation {sorted_ok}, "
                            f"grouped {grouped}")
    for fmt in ("mxfp4", "fp8"):
        for T, D, I, E, k in ((1, 256, 128, 16, 6), (32, 256, 384, 16, 6), (150, 384, 256, 16, 6)):
            w1, w3, w2, scales = _experts(E, D, I, fmt, device, seed=T)
            x = torch.randn(T, D, device=device).to(torch.bfloat16)
            w, idx = _routing(T, E, k, device, seed=T)
            want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
            for mx in ("e4m3", "bf16") if fmt == "mxfp4" else ("e4m3",):
                try:
                    got = moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, config=_moe_cfg(T, fmt, E, k, MX=mx))
                    err = _rel_err(got, want)
                except Exception as e:  # named, and the rest runs
                    failures.append(f"moe {fmt} {mx} T{T}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                if not err <= 3e-2:
                    failures.append(f"moe {fmt} {mx} T{T} D{D} I{I} E{E}: relative error {err:.3g} > 3e-2")
    _experts.cache_clear()
    from kernels.fused_fp8_linear import fp8_linear_fused
    from kernels.fused_gate import router_topk_fused
    from kernels.fused_norm_mhc import hc_post_pre_norm_fused
    from tools.bench_quant import _fp8_weight

    for T in (1, 150):  # mega-gate: the same experts (up to near-ties of bf16 logits: 2% of tokens), weights
        for hashed in (False, True):
            args = _gate_args(T, device, hashed, seed=T)
            (gw, gi), (rw, ri) = router_topk_fused(*args), ref.router_topk(*args)
            og, orr = gi.sort(-1), ri.sort(-1)
            same = (og.values == orr.values).all(-1)
            err = _rel_err(gw.gather(1, og.indices)[same], rw.gather(1, orr.indices)[same]) if same.any() else 0.0
            if not (same.float().mean() >= (1.0 if hashed else 0.98) and err <= 2e-2):
                failures.append(f"mega-gate T{T} hash {hashed}: {int((~same).sum())} tokens chose other experts, "
                                f"weight error {err:.3g}")
    for T, D in ((1, 4096), (150, 4096), (5, 200)):  # mega-mHC
        args = _mhc_args(T, D, device, seed=T)
        for name, got, want in zip(("streams", "post", "comb", "normed x"), hc_post_pre_norm_fused(*args),
                                   ref.hc_post_pre_norm(*args)):
            err = _rel_err(got, want)
            if not err <= 2e-2:
                failures.append(f"mega-mHC T{T} D{D} {name}: relative error {err:.3g} > 2e-2")
    for T in (1, 32, 150):  # each weight conversion, and a stacked pair's two outputs from one launch
        q, s = _fp8_weight(640, 512, device, seed=T)
        x = torch.randn(T, 512, device=device).to(torch.bfloat16)
        want = ref.linear(x, q, s)
        for cvt in W_CVTS + ("gemv",):
            for split in (None, 384):
                cfg = GEMV_CONFIGS[0] if cvt == "gemv" else {**_DEQUANT_CHECK, "W_CVT": cvt}
                try:
                    got = fp8_linear_fused(x, q, s, config=cfg, split_n=split)
                    err = _rel_err(torch.cat(got, -1) if split else got, want)
                except Exception as e:  # named, and the rest runs
                    failures.append(f"fp8 linear {cvt} T{T} split {split}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                if not err <= 2e-2:
                    failures.append(f"fp8 linear {cvt} T{T} split {split}: relative error {err:.3g} > 2e-2")
    for T, G, R, K in ((1, 8, 256, 512), (150, 3, 128, 640)):  # wo_a in one launch, split-K reduced in the kernel
        q, s = _fp8_weight(G * R, K, device, seed=T)
        x = torch.randn(T, G, K, device=device).to(torch.bfloat16)
        want = ref.grouped_linear(x, q, G, s)
        for variant in ("dequant", "mma"):
            err = _rel_err(fp8_linear_fused(x, q, s, variant=variant, groups=G), want)
            if not err <= (2e-2 if variant == "dequant" else 0.1):
                failures.append(f"fp8 grouped linear {variant} T{T} G{G}: relative error {err:.3g}")
    from kernels.fused import grouped_linear_fused
    from kernels.fused_norm_mhc import hc_pre_fused

    for T in (300, 513):  # wo_a from the cuBLAS rows: one call, each group read in place (M off a multiple of 4)
        q, s = _fp8_weight(8 * 1024, 4096, device, seed=T)
        x = torch.randn(T, 8, 4096, device=device).to(torch.bfloat16)
        err = _rel_err(grouped_linear_fused(x, q, 8, s), ref.grouped_linear(x, q, 8, s))
        if not err <= 0.1:
            failures.append(f"fp8 grouped linear (cublas) T{T}: relative error {err:.3g}")
    for T in (300, 513):  # a stacked pair (wq_a over wkv) from the cuBLAS rows: two GEMMs, each output contiguous
        q, s = _fp8_weight(1536, 4096, device, seed=T)
        x = torch.randn(T, 4096, device=device).to(torch.bfloat16)
        got = fp8_linear_fused(x, q, s, split_n=1024)
        err = _rel_err(torch.cat(got, -1), ref.linear(x, q, s))
        if not (err <= 0.1 and all(g.is_contiguous() for g in got)):
            failures.append(f"fp8 stacked pair (cublas) T{T}: relative error {err:.3g}, contiguous "
                            f"{[g.is_contiguous() for g in got]}")
    for T in (1, 3, 32, 300):  # hc_pre: the finish kernel's token tiles at decode, the mix's prefill tiles
        h = torch.randn(T, 4, 4096, device=device).to(torch.bfloat16)
        fn, base, scale = (torch.randn(24, 4 * 4096, device=device) * 0.02, torch.randn(24, device=device) * 0.1,
                           torch.rand(3, device=device) + 0.5)
        for name, got, want in zip(("post", "comb", "x"), hc_pre_fused(h, fn, base, scale, 1e-6, 1e-6, 20),
                                   ref.hc_pre(h, fn, base, scale, 1e-6, 1e-6, 20)):
            err = _rel_err(got, want)
            if not err <= 2e-2:
                failures.append(f"hc_pre T{T} {name}: relative error {err:.3g} > 2e-2")
    return failures + bench_compress.check(device)


def _row(op: str, shape: str, rows: int, variant: str, seconds: float | None, floor_s: float | None,
         base_s: float | None = None, error: str | None = None) -> dict:
    return {"op": op, "shape": shape, "rows": rows, "variant": variant, "seconds": seconds, "floor_s": floor_s,
            "vs_old": None if seconds is None or base_s is None else base_s / seconds, "error": error}


def _timed(fn_list) -> tuple[float | None, str | None]:
    try:
        return graph_time(fn_list), None
    except Exception as e:  # reported in the table; the run goes on
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def bench_align(device) -> list[dict]:
    from kernels import quant_configs
    from kernels import reference as ref
    from kernels.fused_moe_align import moe_align_fused

    out = []
    E, k = DEPTH_MOE["E"], DEPTH_MOE["k"]
    for T in ROWS + (2048,):
        bm = quant_configs.moe_config(T, T * k, E, "mxfp4")["gate_up"]["BLOCK_M"]
        idx = [_routing(T, E, k, device, seed=s)[1] for s in range(4)]
        old, err_old = _timed([lambda i=i: ref.moe_align(i, E, bm) for i in idx])
        new, err = _timed([lambda i=i: moe_align_fused(i, E, bm) for i in idx])
        out.append(_row("moe_align", f"E{E} k{k} m{bm}", T, "torch ops (old)", old, None, error=err_old))
        out.append(_row("moe_align", f"E{E} k{k} m{bm}", T, "one kernel", new, None, old, err))
    return out


def bench_moe(device, fmt: str) -> list[dict]:
    from kernels.fused_moe import moe_experts_fused

    D, I, E, k = DEPTH_MOE["D"], DEPTH_MOE["I"], DEPTH_MOE["E"], DEPTH_MOE["k"]
    w1, w3, w2, scales = _experts(E, D, I, fmt, device)
    out = []
    for T in ROWS:
        x = torch.randn(T, D, device=device).to(torch.bfloat16)
        routings = [_routing(T, E, k, device, seed=T + s) for s in range(4)]
        hit = int(torch.unique(routings[0][1]).numel())
        floor = moe_floor(T, hit, D, I, k, fmt)["floor_s"]
        old = {**_tile16(fmt), "MX": "e4m3", "SPLIT_K": 1} if fmt == "mxfp4" else {**_tile16(fmt), "SPLIT_K": 1}
        variants = [("16-row tiles, no split (old)", _moe_cfg(T, fmt, E, k, **old)),
                    ("the engine's tiles", _moe_cfg(T, fmt, E, k))]
        if fmt == "mxfp4":  # the engine's default is the "bf16" decode; its interleave-free twin beside it
            variants.append(("the engine's tiles, bf16-parts decode", _moe_cfg(T, fmt, E, k, MX="bf16-parts")))
        base = None
        for name, cfg in variants:
            t, err = _timed([lambda rw=rw, ri=ri, cfg=cfg: moe_experts_fused(x, w1, w3, w2, rw, ri, 10.0, scales,
                                                                             config=cfg) for rw, ri in routings])
            label = f"{name} m{cfg['gate_up']['BLOCK_M']} n{cfg['gate_up']['BLOCK_N']}"
            out.append(_row(f"moe {fmt}", f"E{E} D{D} I{I}", T, label, t, floor, base, err))
            base = base or t
    _experts.cache_clear()
    return out


W_CVTS = ("cast", "f32", "int")  # kernels/quant_configs.py: e4m3 -> bf16 in the dequant GEMV
_DEQUANT_CHECK = {"variant": "dequant", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 4,
                  "num_stages": 3}
GEMV_CONFIGS = ({"variant": "gemv", "BLOCK_N": 16, "BLOCK_K": 512, "WAVES": 8, "num_warps": 4, "num_stages": 1},
                {"variant": "gemv", "BLOCK_N": 32, "BLOCK_K": 256, "WAVES": 8, "num_warps": 4, "num_stages": 1},
                {"variant": "gemv", "BLOCK_N": 16, "BLOCK_K": 512, "WAVES": 16, "num_warps": 4, "num_stages": 1})
STACKED = {"wq_a+wkv": (1024, 512, 4096), "shared w1+w3": (2048, 2048, 4096)}  # N1, N2, K
FP8_SHAPES = {"wq_a": (1024, 4096), "wkv": (512, 4096), "wo_b": (4096, 8192), "shared_w1": (2048, 4096),
              "shared_w2": (4096, 2048)}
WO_A = (8, 1024, 4096)  # groups, rows per group, K per group


def bench_fp8(device) -> list[dict]:
    from kernels import quant_configs
    from kernels.fused_fp8_linear import fp8_linear_fused
    from tools.bench_quant import ROTATE_BYTES, _fp8_weight, linear_floor

    def rotated(n, k):  # copies enough that one timed graph walks past the L2
        q, s = _fp8_weight(n, k, device)
        return [(q, s)] + [(q.clone(), s.clone()) for _ in range(max(0, min(63, int(ROTATE_BYTES) // (n * k))))]

    out = []
    for T in ROWS:
        for name, (n, k) in FP8_SHAPES.items():
            ws = rotated(n, k)
            x = torch.randn(T, k, device=device).to(torch.bfloat16)
            cfg = quant_configs.fp8_linear_config(T, n, k)
            floor = linear_floor(T, n, k, "mma")["floor_s"]
            base = None
            for cvt in W_CVTS if cfg["variant"] == "dequant" else (None,):
                c = {**cfg, "W_CVT": cvt} if cvt else cfg
                t, err = _timed([lambda wq=wq, sc=sc, c=c: fp8_linear_fused(x, wq, sc, config=c) for wq, sc in ws])
                label = f"{cfg['variant']} m{cfg['BLOCK_M']} n{cfg['BLOCK_N']}" + (f" W_CVT {cvt}" if cvt else "")
                out.append(_row("fp8 linear", f"{name} {n}x{k}", T, label + (" (old)" if cvt == "cast" else ""), t,
                                floor, base, err))
                base = base or t
            for c in GEMV_CONFIGS if T == 1 else ():
                t, err = _timed([lambda wq=wq, sc=sc, c=c: fp8_linear_fused(x, wq, sc, config=c) for wq, sc in ws])
                out.append(_row("fp8 linear", f"{name} {n}x{k}", T, f"gemv n{c['BLOCK_N']} k{c['BLOCK_K']} "
                                f"waves {c['WAVES']}", t, floor, base, err))
        for name, (n1, n2, k) in STACKED.items():
            ws = rotated(n1 + n2, k)
            x = torch.randn(T, k, device=device).to(torch.bfloat16)
            floor = linear_floor(T, n1 + n2, k, "mma")["floor_s"]
            two, err_two = _timed([lambda wq=wq, sc=sc: (fp8_linear_fused(x, wq[:n1], sc[:n1 // 128]),
                                                         fp8_linear_fused(x, wq[n1:], sc[n1 // 128:])) for wq, sc in ws])
            one, err = _timed([lambda wq=wq, sc=sc: fp8_linear_fused(x, wq, sc, split_n=n1) for wq, sc in ws])
            out.append(_row("fp8 linear", f"{name} {n1 + n2}x{k}", T, "two launches (old)", two, floor, error=err_two))
            out.append(_row("fp8 linear", f"{name} {n1 + n2}x{k}", T, "stacked, one launch", one, floor, two, err))
        G, R, K = WO_A
        q, s = _fp8_weight(G * R, K, device)
        x = torch.randn(T, G, K, device=device).to(torch.bfloat16)
        blk = R // 128
        floor = linear_floor(T, G * R, K, "mma")["floor_s"]
        per_group = [lambda g=g: fp8_linear_fused(x[:, g], q[g * R:(g + 1) * R], s[g * blk:(g + 1) * blk])
                     for g in range(G)]
        old, err_old = _timed([lambda: [f() for f in per_group]] * 4)
        new, err = _timed([lambda: fp8_linear_fused(x, q, s, groups=G)] * 4)
        out.append(_row("fp8 linear", f"wo_a {G}x{R}x{K}", T, "one call per group (old)", old, floor, error=err_old))
        out.append(_row("fp8 linear", f"wo_a {G}x{R}x{K}", T, "all groups, one launch", new, floor, old, err))
        if T == 1:
            t, err = _timed([lambda: fp8_linear_fused(x, q, s, groups=G, config=GEMV_CONFIGS[0])] * 4)
            out.append(_row("fp8 linear", f"wo_a {G}x{R}x{K}", T, "all groups, one gemv launch", t, floor, old, err))
    return out


def _mhc_args(T: int, D: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, 4, D, device=device, generator=g).to(torch.bfloat16)
    out = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    post, comb = torch.rand(T, 4, device=device, generator=g) * 2, torch.rand(T, 4, 4, device=device, generator=g)
    fn = torch.randn(24, 4 * D, device=device, generator=g) * 0.02
    base, scale = torch.randn(24, device=device, generator=g) * 0.3, torch.rand(3, device=device, generator=g) + 0.5
    return (h, out, post, comb, fn, base, scale, torch.rand(D, device=device, generator=g) + 0.5, 1e-6, 1e-6, 1e-6, 20)


def bench_mhc(device) -> list[dict]:
    from kernels import fused_norm_mhc as fm

    D = DEPTH_MOE["D"]
    out = []
    for T in ROWS:
        args = _mhc_args(T, D, device)
        h, blk, post, comb, fn, base, scale, w, hc_eps, eps, out_eps, iters = args

        def old():
            new = fm.hc_post_fused(h, blk, post, comb)
            p2, c2, x = fm.hc_pre_fused(new, fn, base, scale, hc_eps, eps, iters)
            return fm.rms_norm_fused(x, w, out_eps)

        nbytes = 24 * 4 * D * 4 + T * (4 * D * 2 * 2 + D * 2 * 2)
        t_old, err_old = _timed([old] * 4)
        t_new, err = _timed([lambda: fm.hc_post_pre_norm_fused(*args)] * 4)
        floor = nbytes / H200["bytes_per_s"]
        out.append(_row("mega-mHC", f"D{D}", T, "hc_post, hc_pre, rms_norm (old)", t_old, floor, error=err_old))
        out.append(_row("mega-mHC", f"D{D}", T, "hc_post_pre_norm, 2 launches", t_new, floor, t_old, err))
    return out


def _gate_args(T: int, device, hashed: bool = False, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    E, D, k = 256, DEPTH_MOE["D"], DEPTH_MOE["k"]
    x = torch.randn(T, D, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, device=device, generator=g) / D**0.5).to(torch.bfloat16)
    bias = torch.randn(E, device=device, generator=g) * 0.1
    hash_ids = torch.rand(T, E, device=device, generator=g).argsort(-1)[:, :k] if hashed else None
    return x, w, None if hashed else bias, k, 1.5, "sqrtsoftplus", hash_ids


def bench_gate(device) -> list[dict]:
    from kernels import reference as ref
    from kernels.fused_gate import router_topk_fused

    out = []
    for T in ROWS:
        for hashed in (False, True):
            args = _gate_args(T, device, hashed)
            nbytes = args[1].numel() * 2 + T * args[0].shape[1] * 2
            t_old, err_old = _timed([lambda: ref.router_topk(*args)] * 4)
            t_new, err = _timed([lambda: router_topk_fused(*args)] * 4)
            shape = "E256 D4096 " + ("hash" if hashed else "top-6")
            floor = nbytes / H200["bytes_per_s"]
            out.append(_row("mega-gate", shape, T, "cuBLAS + torch ops (reference)", t_old, floor, error=err_old))
            out.append(_row("mega-gate", shape, T, "one launch", t_new, floor, t_old, err))
    return out


def _tile16(fmt: str) -> dict:
    from kernels import quant_configs

    return quant_configs.MOE_DECODE[fmt][16]


def table(rows: list[dict]) -> str:
    lines = [f"{'op':<12}{'shape':<18}{'rows':>5}  {'variant':<44}{'us':>9}{'floor us':>9}{'of floor':>9}{'x old':>7}"]
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"{r['op']:<12}{r['shape']:<18}{r['rows']:>5}  {r['variant']:<44}  {r['error']}")
            continue
        fl = f"{r['floor_s'] * 1e6:>9.1f}{r['floor_s'] / r['seconds']:>9.0%}" if r["floor_s"] else f"{'-':>9}{'-':>9}"
        vs = f"{r['vs_old']:>7.2f}" if r["vs_old"] else f"{'-':>7}"
        lines.append(f"{r['op']:<12}{r['shape']:<18}{r['rows']:>5}  {r['variant']:<44}{r['seconds'] * 1e6:>9.1f}{fl}{vs}")
    return "\n".join(lines)


PARTS = {"align": bench_align, "moe-mxfp4": lambda d: bench_moe(d, "mxfp4"), "moe-fp8": lambda d: bench_moe(d, "fp8"),
         "fp8": bench_fp8, "gate": bench_gate, "mhc": bench_mhc,
         "compress": lambda d: bench_compress.bench(d, _timed, _row)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=sorted(PARTS), action="append",
                    help="time only these parts (repeatable; the check runs whole either way)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fused: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    start = time.perf_counter()
    failures = check(device)
    print(f"check: {'OK' if not failures else 'FAILED'} ({time.perf_counter() - start:.1f} s)", flush=True)
    for f in failures:
        print("  MISMATCH", f, flush=True)
    rows: list[dict] = []
    for name, part in PARTS.items():
        if args.only and name not in args.only:
            continue
        try:
            rows += part(device)
        except Exception as e:  # record, keep going
            rows.append(_row("error", "", 0, "", None, None, error=f"{type(e).__name__}: {e}"[:200]))
        print(f"  ... {len(rows)} rows ({time.perf_counter() - start:.1f} s)", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "hw": H200, "failures": failures, "rows": rows},
                          f, indent=1)
    print(f"total {time.perf_counter() - start:.1f} s")
    print(table(rows))
    return exit_status("bench_fused", failures)


if __name__ == "__main__":
    sys.exit(main())
