"""The quantized kernels on CUDA: checked against their torch references, then a small sweep of
launch configurations per shape, timed against floors; prints the winners.

    python -m tools.bench_quant [--json OUT/quant.json] [--quick] [--budget S]   (suite kernels_quant)
    python -m tools.bench_quant --mx-ab ...   the MXFP4 MoE only: the table's tile against its frag decodes
    python -m tools.bench_quant --v41 ...   DeepSeek-V4.1-Flash's FP8 linears, 32x32 tiles (suite kernels_fp8)
    python -m tools.bench_quant --linear-rows 96,128,150,192,256 ...   V4's FP8 linears alone (suite kernels_fp8_mid)
    python -m tools.bench_quant --write-configs ...   also merges the winners into kernels/configs/*.json

1. Check (fails the run, exit 1): the block-scaled FP8 linear, both variants (the "mma" one on the
   FP8 tensor cores), and the fused MoE on MXFP4 and FP8 experts (decode and sorted paths), vs
   kernels/reference.py, on small awkward shapes with the table's configurations.
2. Sweep V4-Flash shapes at decode (1, 32, 150 rows) and prefill (2048, 8192 tokens): each FP8
   dense linear ("dequant" candidates at decode, "mma" candidates everywhere) and the MoE (MXFP4
   at all rows, FP8 experts at decode). Each candidate is checked against the reference on the
   real shape, then timed by CUDA-graph replay over enough weight copies / routings that the L2
   holds none of it (a graph keeps host overhead out: the engine replays graphs at decode); the
   winner is also timed eagerly (back-to-back launches: host overhead shows as the difference).
   A candidate that fails to compile, run or match is skipped and reported. Floors on the H200:
   bytes / 4.2 TB/s and FLOPs / peak (FP8 linears: the FP8 peak 1580 TFLOP/s; the MoE multiplies
   in bf16: 790). JSON: every candidate, the winners in kernels/quant_configs.py's form ("best"),
   the "crossover" (rows up to which "dequant" wins per weight shape), failures. Table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys
import time

import torch

from tools.kernel_device import exit_status, graph_time

H200 = {"bytes_per_s": 4.2e12, "bf16_flops": 790e12, "fp8_flops": 2 * 790e12}
DECODE_ROWS = (1, 32, 150)
PREFILL_ROWS = (2048, 8192)
# V4-Flash's FP8 dense linears, (N, K): attention projections and the shared expert
LINEAR_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared_w1": (2048, 4096)}
# DeepSeek-V4.1-Flash's (hidden 5120, q LoRA 1280, head 512, o LoRA 1024 x 8 groups, expert width 2304), 32x32 tiles
V41_LINEAR_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_a": (1024, 4096),
                     "wo_b": (5120, 8192), "shared_w1": (2304, 5120), "shared_w2": (5120, 2304)}
V41_BLOCK = 32
MOE_SHAPE = {"D": 4096, "I": 2048, "E": 256, "k": 6}
MOE_DEPTH_SHAPE = {**MOE_SHAPE, "E": 16}  # the depth-43 benchmark checkpoint: ~56 rows per expert at 150 rows
L2_BYTES = 60e6
ROTATE_BYTES = 3 * L2_BYTES  # weight bytes one timed graph walks through, so the L2 holds none of it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_floor(m: int, n: int, k: int, variant: str, hw: dict = H200, block: int = 128) -> dict:
    """Bytes: FP8 weight + float32 block scales + bf16 activations in and out. FLOPs at the bf16 peak
    (dequant: bf16 MMA) or the FP8 peak (mma)."""
    nbytes = n * k + cdiv(n, block) * cdiv(k, block) * 4 + 2 * m * k + 2 * m * n
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


def linear_candidates(m: int) -> list[dict]:
    """Decode: the dequant GEMV (N tile x split-K x warps x stages) and the small mma tiles; 65-256 rows (a big
    decode batch, where one 64-row tile re-reads and re-converts each weight tile per 64 rows): also 128- and 256-row
    tiles of both; prefill: mma tiles from 64x128 to 128x256."""
    out = []
    if 64 < m <= 256:
        for bm, bn, bk, w, st in ((64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 4), (128, 32, 128, 4, 4),
                                  (128, 64, 128, 4, 3), (128, 64, 128, 8, 4), (128, 128, 128, 8, 3),
                                  (256, 64, 128, 8, 3)):  # one row tile for up to 256 (sm_90 offline: no spills)
            out.append({"variant": "dequant", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 0,
                        "num_warps": w, "num_stages": st})
        out += [{"variant": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st}
                for bm, bn, w, st in ((64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3), (128, 64, 4, 4),
                                      (128, 64, 8, 3), (128, 128, 8, 4), (256, 64, 8, 3))]
        return out
    if m <= 256:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        for bn, bk, w, st, split in ((64, 128, 4, 4, 0), (32, 128, 4, 4, 0), (128, 128, 4, 3, 0), (128, 128, 8, 4, 0),
                                     (64, 64, 4, 6, 0), (64, 128, 4, 4, 1)):
            out.append({"variant": "dequant", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                        "num_warps": w, "num_stages": st})
    # prefill: 128x256 / 256x128 spill (SASS: 488-byte stack) and ran 2x slower; 4-warp tiles fit 2 programs per SM
    mma = ((64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3)) if m <= 256 else \
        ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 4), (64, 128, 4, 3))
    out += [{"variant": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st}
            for bm, bn, w, st in mma]
    return out


# --mx-ab: the table's MXFP4 tile against the same tile decoding into the MMA's operand registers, two multiplies and
# one a value pair (kernels/fused_dequant.py: mxfp4_frag_tile, _words_bf16), from the weights as stored and arranged
# lane-major (mxfp4_frag16_tile: 16-byte copies); at decode's few rows the GEMVs too
MX_AB_MODES = ("bf16-frag16", "bf16-frag16-one-mul", "bf16-frag", "bf16-frag-one-mul")


def moe_ab_candidates(rows: int, experts: int = 256) -> list[dict]:
    """--mx-ab's candidates: the engine's table tile for this call (quant_configs.moe_config), at decode's few rows the
    GEMVs of kernels/moe_gemv.py, then the table's tile with each of MX_AB_MODES (the newest first: a budget cuts the
    sweep's tail)."""
    from kernels import moe_gemv, quant_configs
    from kernels.fused_moe import with_mx

    table = quant_configs.moe_config(rows, rows * MOE_SHAPE["k"], experts, "mxfp4")
    out = [table]
    if rows <= moe_gemv.MOE_GEMV_MAX_ROWS:
        # the variant moe_gemv's GEMVs (kernels/moe_gemv.py) in its tile and around it (sm_90 offline, Triton 3.6:
        # 117 registers at 32 x 256 / 4 warps, 88 at 32 x 128 and 16 x 256, no spills)
        out += [{"gemv": moe_gemv.TILES | t} for t in ({}, {"BLOCK_K": 128}, {"BLOCK_N": 16},
                                                       {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8})]
    out += [with_mx(table, mode) for mode in MX_AB_MODES]
    if rows * MOE_SHAPE["k"] > quant_configs.MOE_DECODE_MAX_PAIRS:
        # prefill: the table's tile (128 pairs x 64 weight rows, 4 warps) holds one CTA an SM (118 KB of shared
        # memory), one warp a scheduler, and decodes each weight once per 128 pairs; two warpgroups over twice the
        # pairs or the rows decode it half as often with two warps a scheduler (sm_90 offline, Triton 3.6: 691 / 636
        # instructions a K step for twice the table's 850's work, 8 bytes spilled against 56)
        tiles = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "MX": "bf16-frag"}
                 for bm, bn in ((256, 64), (128, 128))]
        out += [{"gate_up": c, "down": c} for c in tiles]
    return out


def moe_candidates(rows: int, fmt: str, experts: int = 256) -> list[dict]:
    """{"gate_up", "down"} pairs (the same tiles for both). Decode: the table's tile for the BLOCK_M
    that holds an expert's rows this step (quant_configs.moe_fit_block_m) and its neighbours in N tile x warps x pipeline depth, plus the
    16-row tiles of the previous decode kernel (weights re-read once per 16 rows of an expert);
    MXFP4 through the e4m3 placement, tl.dot_scaled ("scaled") and the integer bf16 decode ("bf16")."""
    from kernels import quant_configs

    k = MOE_SHAPE["k"]
    if rows * k <= quant_configs.MOE_DECODE_MAX_PAIRS:
        bm = quant_configs.moe_fit_block_m(rows, rows * k, experts)
        base = quant_configs.MOE_DECODE[fmt][bm]
        alts = [base]
        # the K splits beside the auto rule's (quant_configs.moe_split_k: ~MOE_WAVES programs an SM): at one row
        # gate/up ran 2.26 waves at 3 blocks an SM (ncu, H100), a last wave a quarter full; 2 splits give one
        # wave, 8 give more bytes in flight per SM (the newest candidates first: a budget cuts the sweep's tail)
        if rows <= 32:
            alts += [{**base, "SPLIT_K": s} for s in (2, 8)]
        if fmt == "mxfp4":
            # the decode straight into the MMA's operand registers (kernels/fused_dequant.py, mxfp4_frag_tile): no
            # round trip through shared memory, ~25% fewer instructions a K step in the loop (sm_90, offline)
            alts += [{**base, "MX": "bf16-frag"}, {**base, "MX": "bf16-frag", "num_stages": base["num_stages"] + 1},
                     {**base, "MX": "bf16-frag", "BLOCK_N": base["BLOCK_N"] * 2},
                     {**base, "MX": "bf16-frag", "maxnreg": 128}, {**base, "MX": "bf16-frag-one-mul"}]
            # register caps: at one row gate/up holds 138 registers a thread, so 3 blocks an SM (ncu on the H100,
            # docs/perf/h100-2026-12-06f/ncu_moe_decode_b1.txt); 128 / 96 give 4 / 5, with what spills they cost
            alts += [{**base, "maxnreg": cap} for cap in (128, 96)]
            # or half the K step: both decoded weight tiles live in registers at once, so BLOCK_K 64 needs 72
            # registers (160 at 128, sm_90 compiled offline by tools.sass_report) and half the shared memory
            alts += [{**base, "BLOCK_K": 64}, {**base, "BLOCK_K": 64, "num_stages": base["num_stages"] + 1}]
        alts += [{**base, "BLOCK_N": base["BLOCK_N"] // 2}, {**base, "BLOCK_N": base["BLOCK_N"] * 2},
                 {**base, "num_warps": 12 - base["num_warps"]}, {**base, "num_stages": 7 - base["num_stages"]},
                 {**base, "SPLIT_K": 1}]  # split-K off: what the K splits of few-row steps buy
        if bm > 16:
            alts.append(quant_configs.MOE_DECODE[fmt][16])  # the old re-reading tiles, for the comparison
        if fmt == "mxfp4":  # the integer bf16 decode over row tiles x N tiles x warps that keep the accumulators in registers
            alts += [{**base, "MX": "e4m3"}, {**base, "MX": "scaled"}, {**base, "MX": "bf16-parts"},
                     {**base, "MX": "bf16-parts", "num_stages": 7 - base["num_stages"]}]
            for m in sorted({16, 32, bm, min(64, max(16, bm))}):
                for n, w, st in ((64, 4, 4), (128, 4, 3), (64, 8, 3), (32, 4, 4), (128, 8, 3)):
                    if m * n * 2 <= 128 * 32 * w:  # gate and up float32 accumulators: <= 64 registers a thread
                        alts.append({**quant_configs.MOE_DECODE[fmt][m], "BLOCK_N": n, "num_warps": w, "num_stages": st,
                                     "MX": "bf16"})
        alts = [c for i, c in enumerate(alts) if c not in alts[:i]]
        cfgs = alts
    else:
        tiles = ((64, 128, 64, 8, 3, "scaled"), (128, 64, 128, 4, 3, "scaled"), (128, 128, 64, 8, 3, "scaled"),
                 (64, 128, 64, 8, 3, "e4m3") if rows <= 4096 else (128, 64, 128, 4, 3, "e4m3"))[:4 if fmt == "mxfp4" else 3]
        cfgs = [{"BLOCK_M": bm, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st,
                 **({"MX": mx} if fmt == "mxfp4" else {})} for bm, n, k, w, st, mx in tiles]
        if fmt == "mxfp4":  # the integer bf16 decode on the e4m3 winner's tiles, and straight into the MMA's registers
            # on the table's two prefill tiles (128-row / 4 warps: no spill where "bf16" spills 56 bytes, sm_90 offline)
            cfgs += [{**cfgs[-1], "MX": "bf16"}, {**cfgs[-1], "MX": "bf16-frag"},
                     {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "MX": "bf16-frag"}]
    return [{"gate_up": c, "down": c} for c in cfgs]


def cases(quick: bool = False, v41: bool = False, linear_rows: tuple[int, ...] = ()) -> list[dict]:
    """Every swept shape: FP8 linears and MoE (mxfp4 at all rows, fp8 experts at decode); decode first.
    v41: V4.1-Flash's FP8 linears in 32x32 tiles only (its MXFP4 experts run V4's MoE kernel).
    linear_rows: only V4's FP8 linears, at these rows."""
    if linear_rows:
        return [{"op": "fp8_linear", "name": name, "rows": m, "n": n, "k": k}
                for m in linear_rows for name, (n, k) in LINEAR_SHAPES.items()]
    rows = DECODE_ROWS + (PREFILL_ROWS[:1] if quick else PREFILL_ROWS)
    if v41:
        return [{"op": "fp8_linear", "name": name, "rows": m, "n": n, "k": k, "block": V41_BLOCK}
                for m in rows for name, (n, k) in V41_LINEAR_SHAPES.items()]
    shapes = dict(list(LINEAR_SHAPES.items())[:2]) if quick else LINEAR_SHAPES
    out = [{"op": "fp8_linear", "name": name, "rows": m, "n": n, "k": k}
           for m in rows for name, (n, k) in shapes.items()]
    out += [{"op": "moe", "name": "experts", "rows": m, "fmt": "mxfp4", **MOE_SHAPE} for m in rows]
    out += [{"op": "moe", "name": "experts", "rows": m, "fmt": "fp8", **MOE_SHAPE} for m in DECODE_ROWS]
    out += [{"op": "moe", "name": "depth", "rows": m, "fmt": fmt, **MOE_DEPTH_SHAPE}
            for fmt in ("mxfp4", "fp8") for m in DECODE_ROWS]
    # decode first, the depth checkpoint's MoE (the engine's shape today) first of all: the budget may cut the tail
    return sorted(out, key=lambda c: (c["rows"] > max(DECODE_ROWS), c["name"] != "depth"))


def crossover(results: list[dict]) -> dict:
    """Per (N, K): the largest row count at which "dequant"'s best is at least as fast as "mma"'s
    (0: mma always wins)."""
    out = {}
    for r in results:
        if r["op"] == "fp8_linear":
            t = r.get("by_variant", {})
            key = f"{r['n']}x{r['k']}"
            out.setdefault(key, 0)
            if "dequant" in t and "mma" in t and t["dequant"] <= t["mma"]:
                out[key] = max(out[key], r["rows"])
    return out


def best_table(results: list[dict]) -> dict:
    """The winners in kernels/quant_configs.py's form: FP8_LINEAR[(N, K)] rows -> config, MOE per format."""
    lin, moe = {}, {}
    for r in results:
        if "best" not in r:
            continue
        if r["op"] == "fp8_linear":
            lin.setdefault(f"{r['n']}x{r['k']}", {})[r["rows"]] = r["best"]
        else:
            moe.setdefault(r["fmt"], {})[r["rows"]] = r["best"]
    return {"fp8_linear": lin, "moe": moe}


def _short(cfg: dict) -> str:
    if "gemv" in cfg:
        return "gemv " + _short(cfg["gemv"])
    if "gate_up" in cfg:
        cfg = cfg["gate_up"]
    names = {"variant": "", "BLOCK_M": "m", "BLOCK_N": "n", "BLOCK_K": "k", "SPLIT_K": "s", "GROUP_M": "g",
             "num_warps": "w", "num_stages": "st", "MX": "", "maxnreg": "r"}
    return " ".join(f"{names[k]}{v}" for k, v in cfg.items() if k in names) + (" scaled-tile" if cfg.get("SCALE_TILE") else "")


def table(results: list[dict]) -> str:
    lines = [f"{'op':<11}{'shape':<22}{'rows':>6}  {'best config':<30}{'us':>9}{'eager':>8}{'floor us':>9}"
             f"{'of floor':>9}{'TB/s':>7}{'TFLOP/s':>9}  ok/tried"]
    for r in results:
        shape = f"{r['name']} {r['n']}x{r['k']}" if r["op"] == "fp8_linear" else f"{r['fmt']} E{r['E']} D{r['D']} I{r['I']}"
        tried = f"{sum('seconds' in c for c in r.get('candidates', []))}/{len(r.get('candidates', []))}"
        if "seconds" not in r:
            lines.append(f"{r['op']:<11}{shape:<22}{r['rows']:>6}  {r.get('error', 'no candidate ran')[:60]}  {tried}")
            continue
        t, f = r["seconds"], r["floor"]
        eager = f"{r['eager_seconds'] * 1e6:>8.1f}" if "eager_seconds" in r else f"{'-':>8}"
        lines.append(f"{r['op']:<11}{shape:<22}{r['rows']:>6}  {_short(r['best']):<30}{t * 1e6:>9.1f}{eager}"
                     f"{f['floor_s'] * 1e6:>9.1f}{f['floor_s'] / t:>9.2f}{f['bytes'] / t / 1e12:>7.2f}"
                     f"{f['flops'] / t / 1e12:>9.1f}  {tried}")
    return "\n".join(lines)


def _fp8_weight(n: int, k: int, device, ue8m0: bool = True, seed: int = 0, block: int = 128):
    from kernels.formats import quantize_fp8_block, scale_to_float

    g = torch.Generator(device=device).manual_seed(seed)
    q, s = quantize_fp8_block(torch.randn(n, k, device=device, generator=g) / k**0.5, ue8m0=ue8m0, block=block)
    return q, scale_to_float(s)


@functools.lru_cache(maxsize=2)
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


@contextlib.contextmanager
def _moe_path(path: str):
    """Force the MoE's decode tiles (BLOCK_M from the rows per expert) or prefill tiles, whatever the pair count."""
    from kernels import quant_configs

    saved = quant_configs.MOE_DECODE_MAX_PAIRS
    quant_configs.MOE_DECODE_MAX_PAIRS = 1 << 30 if path == "decode" else 0
    try:
        yield
    finally:
        quant_configs.MOE_DECODE_MAX_PAIRS = saved


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN stays NaN, so `not err <= tol` fails it)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1.0)).item()


def check(device) -> list[str]:
    """Kernels vs references on small awkward shapes; the failures, named (empty: all agree)."""
    from kernels import quant_configs
    from kernels import reference as ref
    from kernels.fused_fp8_linear import fp8_linear_fused
    from kernels.fused_moe import moe_experts_fused

    failures = []
    # V4's 128x128 blocks, and V4.1's 32x32 (the gemv too: the one-row variant)
    shapes = ((1, 256, 512, 128), (33, 200, 300, 128), (150, 384, 1024, 128), (1, 160, 544, 32))
    for m, n, k, block in shapes + ((33, 200, 300, 32),) * (device.type == "cuda"):  # GPU only: slow in the interpreter
        q, s = _fp8_weight(n, k, device, seed=m, block=block)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        want, want_q = ref.linear(x, q, s).float(), ref.linear_act_quant(x, q, s).float()
        scale = want.abs().max().item()
        variants = (("dequant", want, 1e-2), ("mma", want_q, 1e-2), ("mma", want, 0.1))
        for variant, target, tol in variants + ((("gemv", want, 1e-2),) if m == 1 else ()):
            err = (fp8_linear_fused(x, q, s, variant=variant).float() - target).abs().max().item()
            if not err <= tol * scale:  # `not <=` also catches NaN
                failures.append(f"fp8_linear {variant} {m}x{n}x{k} block {block}: max error {err:.3g} > {tol} x {scale:.3g}")
    for fmt in ("mxfp4", "fp8"):
        shapes = ((1, 256, 128, 8, 2), (40, 384, 256, 6, 6)) + ((150, 256, 128, 16, 6),) * (device.type == "cuda")
        for T, D, I, E, k in shapes:  # 16-, 64- and (GPU only: slow in the interpreter) 128-row tiles
            w1, w3, w2, scales = _experts(E, D, I, fmt, device, seed=T)
            x = torch.randn(T, D, device=device).to(torch.bfloat16)
            w, idx = _routing(T, E, k, device, seed=T)
            want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
            # every MXFP4 decode on the GPU; the interpreter (the CPU test of this check) runs one, tests/kernels all
            mxs = ("scaled", "e4m3", "bf16", "bf16-frag") if device.type == "cuda" else ("e4m3",)
            for path, mx in itertools.product(("decode", "sorted"), mxs if fmt == "mxfp4" else ("",)):
                with _moe_path(path):  # the table's tiles; MXFP4 through every decode (the sweep tries them all)
                    cfg = {part: {**c, "MX": mx} if mx else c
                           for part, c in quant_configs.moe_config(T, T * k, E, fmt).items()}
                    try:
                        err = _rel_err(moe_experts_fused(x, w1, w3, w2, w, idx, 10.0, scales, config=cfg), want)
                    except Exception as e:  # a decode that does not compile fails the check, named, and the rest runs
                        failures.append(f"moe {fmt} {mx} {path} T{T}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                if not err <= 3e-2:
                    failures.append(f"moe {fmt} {mx} {path} T{T} D{D} I{I} E{E} k{k}: relative error {err:.3g} > 3e-2")
    _experts.cache_clear()
    return failures


def _eager_time(calls: list) -> float:
    """Seconds per call launched back to back from Python: includes what the host does per call."""
    for fn in calls[:2]:
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for fn in calls:
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / len(calls)


def _sweep(case: dict, candidates: list[dict], run, want, tol_for, calls_for, deadline: float) -> dict:
    """Check (relative error <= tol_for(cfg)) and time each candidate; the fastest correct one is the best."""
    rows = []
    for cfg in candidates:
        row = {"config": cfg}
        rows.append(row)
        if time.perf_counter() > deadline:
            row["error"] = "skipped: time budget spent"
            continue
        try:
            err, tol = _rel_err(run(cfg), want), tol_for(cfg)
            if not err <= tol:
                row["error"] = f"mismatch: relative error {err:.3g} > {tol}"
                continue
            row["seconds"] = graph_time(calls_for(cfg))
        except Exception as e:  # a config that does not compile or run is reported, the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    out = {**case, "candidates": rows}
    ok = [r for r in rows if "seconds" in r]
    if not ok:
        out["error"] = "; ".join(sorted({r["error"][:80] for r in rows}))[:300]
        return out
    best = min(ok, key=lambda r: r["seconds"])
    out.update(best=best["config"], seconds=best["seconds"])
    try:
        out["eager_seconds"] = _eager_time(calls_for(best["config"]))
    except Exception as e:
        out["eager_error"] = f"{type(e).__name__}: {e}"
    return out


def measure_linear(case: dict, device, deadline: float) -> dict:
    from kernels import reference as ref
    from kernels.fused_fp8_linear import fp8_linear_fused

    m, n, k, block = case["rows"], case["n"], case["k"], case.get("block", 128)
    q, s = _fp8_weight(n, k, device, block=block)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    copies = max(1, min(64, cdiv(int(ROTATE_BYTES), n * k)))
    ws = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
    want = ref.linear(x, q, s)
    cands = linear_candidates(m)
    if block < 128:  # the dequant GEMV's steps as one MMA over the scaled tile, against its 32-wide sub-steps
        cands += [{**c, "SCALE_TILE": True} for c in cands if c["variant"] == "dequant"] + [{"variant": "unpacked"}]
    res = _sweep(case, cands, lambda cfg: fp8_linear_fused(x, q, s, config=cfg), want,
                 lambda cfg: 0.1 if cfg["variant"] == "mma" else 2e-2,  # mma rounds activations to e4m3
                 lambda cfg: [functools.partial(fp8_linear_fused, x, wq, ws_, config=cfg) for wq, ws_ in ws], deadline)
    by = {}
    for r in res["candidates"]:
        if "seconds" in r:
            v = r["config"]["variant"] + (" scaled-tile" if r["config"].get("SCALE_TILE") else "")
            by[v] = min(by.get(v, 1e9), r["seconds"])
    res["by_variant"] = by
    res["floor"] = linear_floor(m, n, k, "mma", block=block)  # the lower of the two floors: FP8 peak
    return res


def measure_moe(case: dict, device, deadline: float) -> dict:
    from kernels import reference as ref
    from kernels.fused_moe import arrange_lane_major, moe_experts_fused

    m, D, I, E, k = case["rows"], case["D"], case["I"], case["E"], case["k"]
    w1, w3, w2, scales = _experts(E, D, I, case["fmt"], device)
    x = torch.randn(m, D, device=device).to(torch.bfloat16)
    routings = [_routing(m, E, k, device, seed=m + i) for i in range(4)]
    w, idx = routings[0]
    hit = int(torch.unique(idx).numel())
    want = ref.moe_experts(x, w1, w3, w2, w, idx, 10.0, scales)
    candidates = moe_ab_candidates(m, E) if case.get("ab") else moe_candidates(m, case["fmt"], E)
    lanes = []  # the experts arranged lane-major, made at the first "bf16-frag16" candidate

    def experts(cfg: dict) -> tuple:
        if not all(str(c.get("MX", "")).startswith("bf16-frag16") for c in cfg.values()):
            return w1, w3, w2
        lanes[:] = lanes or [arrange_lane_major(v) for v in (w1, w3, w2)]
        return tuple(lanes)

    res = _sweep(case, candidates,
                 lambda cfg: moe_experts_fused(x, *experts(cfg), w, idx, 10.0, scales, config=cfg), want,
                 lambda cfg: 3e-2,
                 lambda cfg: [functools.partial(moe_experts_fused, x, *experts(cfg), rw, ri, 10.0, scales, config=cfg)
                              for rw, ri in routings], deadline)
    return {**res, "experts_hit": hit, "floor": moe_floor(m, hit, D, I, k, case["fmt"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="two linear shapes, one prefill size")
    ap.add_argument("--budget", type=float, default=220.0, help="seconds after which remaining candidates are skipped")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE cases (MXFP4 and FP8 experts)")
    ap.add_argument("--mx-ab", action="store_true",
                    help="only the MXFP4 MoE, each shape's table tile against MX_AB_MODES on it (each checked against "
                         "the reference; the other kernels' check skipped): a quick A/B")
    ap.add_argument("--v41", action="store_true", help="DeepSeek-V4.1-Flash's FP8 linears in 32x32 tiles instead")
    ap.add_argument("--linear-rows", default="", help="only V4's FP8 linears, at these rows (e.g. 96,128,150,192,256)")
    ap.add_argument("--write-configs", action="store_true",
                    help="merge the winners into the tuned tables, kernels/configs/*.json (kernels/tuned_configs.py)")
    args = ap.parse_args()
    if args.write_configs and args.v41:
        ap.error("--write-configs: the tuned tables hold 128x128-block tiles only, not --v41's")
    if args.write_configs and args.mx_ab:
        ap.error("--write-configs: --mx-ab is an A/B of kernel variants (its GEMV rows are no table tile)")
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    start = time.perf_counter()
    deadline = start + args.budget
    failures = [] if args.mx_ab else check(device)
    print(f"check: {'skipped (--mx-ab)' if args.mx_ab else 'OK' if not failures else 'FAILED'} "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    for f in failures:
        print("  MISMATCH", f, flush=True)
    results = []
    linear_rows = tuple(int(r) for r in args.linear_rows.split(",") if r)
    todo = [c for c in cases(args.quick, args.v41, linear_rows) if c["op"] == "moe" or not args.moe_only]
    if args.mx_ab:
        todo = [{**c, "ab": True} for c in todo if c["op"] == "moe" and c["fmt"] == "mxfp4"]
    for case in todo:
        t0 = time.perf_counter()
        try:
            r = (measure_linear if case["op"] == "fp8_linear" else measure_moe)(case, device, deadline)
        except Exception as e:  # record, keep going
            r = {**case, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(f"  {case['op']} {case['name']} {case.get('fmt', '')} rows {case['rows']}: "
              f"{r['seconds'] * 1e6:.1f} us {_short(r['best'])}" if "seconds" in r else
              f"  {case['op']} {case['name']} rows {case['rows']}: {r.get('error')}", f"({time.perf_counter() - t0:.1f} s)",
              flush=True)
        torch.cuda.empty_cache()
        report = {"device": torch.cuda.get_device_name(), "hw": H200, "failures": failures,
                  "crossover": crossover(results), "best": best_table(results), "results": results,
                  "seconds": time.perf_counter() - start}
        if args.json:  # after every row: a run cut short by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    print(f"crossover (rows where dequant still wins, per NxK): {report['crossover']}")
    print(f"total {time.perf_counter() - start:.1f} s")
    print(table(results))
    if args.write_configs and not failures:
        from kernels import tuned_configs

        measured_by = " ".join(["tools/bench_quant.py", *sys.argv[1:]])
        for path in tuned_configs.merge_sweep(results, measured_by, MOE_SHAPE["k"]):
            print(f"wrote {path}")
    return exit_status("bench_quant", failures)




if __name__ == "__main__":
    sys.exit(main())
