"""The launch configuration of every quantized kernel, per shape: the one dispatch table.

The measured tiles are data: kernels/configs/{fp8_linear,moe},device_name=NVIDIA_H200.json, which
tools/bench_quant.py --write-configs rewrites from its sweep (kernels/tuned_configs.py). Otherwise the reasoned defaults:
- FP8 linear, decode (<= 64 rows): "dequant" streams the weight with many programs (narrow N
  tiles times split-K, so all 132 SMs read), swap-AB (weight rows on the MMA's M side).
- FP8 linear, from a few hundred rows: "mma", activations quantized once, 128x128 FP8 tiles.
- MoE: one program per (expert tile of BLOCK_M rows, N tile). Decode (pairs <= MOE_DECODE_MAX_PAIRS):
  BLOCK_M from the rows an expert can have this step where that measured faster (moe_block_m: 16
  or 32 rows), so an expert's weights are read once or a few times per step; prefill: the measured
  tiles, 64 rows where an entry gives none.
A config: variant, BLOCK_M, BLOCK_N, BLOCK_K (dequant), SPLIT_K (0: enough for ~2 waves of
programs), GROUP_M (mma: programs sharing weight tiles run together), num_warps, num_stages,
W_CVT (dequant, bf16 activations: how the e4m3 tile becomes bf16; "cast" e4m3 -> f16 -> bf16 costs
1.5 conversion-unit instructions per weight byte in the SASS (F2FP + F2F.BF16.F16, the unit Hopper
has least of), "f32" 1 (F2FP unpack + pack, the f16 -> f32 step on the FMA pipe), "int" none
(PRMT / LOP3 / IMAD.SHL / HMUL2: kernels/fused_fp8_linear._E4M3_BF16_ASM); "int" is the default:
1.04-1.28x faster than "cast" at 1 / 32 / 150 rows on the H200, "f32" within a few percent of it
(tools/bench_fused.py's fp8 linear rows, docs/perf/h200-2026-12-01-s6/fused3.log).
"""

from __future__ import annotations

import functools

from kernels import tuned_configs

SMS = 132  # H200 multiprocessors; split-K sizing only (the interpreter ignores it)


def hopper(device=None) -> bool:
    """Whether the CUDA device (a torch.device; None: the current one) is sm90 (H100 / H200), where cuBLAS's
    blockwise FP8 GEMM and torch's grouped GEMM were measured (and cuBLAS has the blockwise FP8 recipe); other GPUs
    keep the Triton kernels."""
    import torch

    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


W_CVT = "int"
_DECODE = {"variant": "dequant", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 4,
           "num_stages": 4, "W_CVT": W_CVT}
_MID = {"variant": "mma", "BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
_PREFILL = {"variant": "mma", "BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}

# One activation row on the CUDA cores (no MMA): 1.13-1.45x faster than the dequant GEMV at 1 row for N <= 4096,
# K 2048-4096 (tools/bench_fused.py's fp8 linear rows, docs/perf/h200-2026-12-01-s6/fused3.log); wo_b (K 8192) keeps
# the dequant GEMV.
_GEMV = {"variant": "gemv", "BLOCK_N": 16, "BLOCK_K": 512, "WAVES": 8, "num_warps": 4, "num_stages": 1}
# a variant asked for by name (benchmarks, checks) where the table picks another for the shape: its own tiles
FP8_VARIANT_TILES = {"gemv": _GEMV, "dequant": _DECODE, "mma": _PREFILL, "unpacked": {"variant": "unpacked"},
                     "cublas": {"variant": "cublas"}}


def _measured_linear() -> dict:
    """(N, K) -> [(max rows or None, config), ...] from kernels/configs/fp8_linear,device_name=NVIDIA_H200.json."""
    shapes = tuned_configs.load("fp8_linear")["shapes"]
    return {tuple(int(d) for d in key.split("x")): [(bound, cfg) for bound, cfg in rows] for key, rows in shapes.items()}


_MEASURED_LINEAR = _measured_linear()
# (N, K) or "default" -> [(max rows, config), ...] ascending; None: any row count
FP8_LINEAR: dict = {
    "default": [(1, _GEMV), (16, _DECODE), (64, {**_DECODE, "BLOCK_M": 64}), (512, _MID), (None, _PREFILL)],
    # stacked pairs (engine/models/stacked_linears.py), not measured: their first part's tiles. wq_a over
    # wkv, and the shared expert's w1 over w3 at tensor_parallel_size 1
    (1536, 4096): _MEASURED_LINEAR[(1024, 4096)],
    (4096, 4096): _MEASURED_LINEAR[(2048, 4096)],
    **_MEASURED_LINEAR,
}

MOE_DECODE_MAX_PAIRS = 1024  # (token, expert) pairs up to which the decode tiles apply (150 rows x top-6)
# The largest decode row tile measured faster than the smaller ones, per stored format (tools/bench_quant.py
# --moe-only, docs/perf/h200-2026-12-01-s6/quant_moe.json, 16 experts at 150 rows): MXFP4 64 rows (335 us; 128 rows
# 421 us, 16 rows 552 us), FP8 128 rows (520 us vs 639 us at 16); bf16 experts, which that sweep has no case for,
# keep 32 (tools/bench_fused.py's MoE rows, docs/perf/h200-2026-12-01-s5/fused.log).
MOE_BLOCK_M_MAX = {"dense": 32, "fp8": 128, "mxfp4": 64}


def moe_fit_block_m(tokens: int, pairs: int, experts: int) -> int:
    """The decode row tile that holds an expert's rows: an expert has at most `tokens` rows this step
    (a token picks it once) and, routed evenly, pairs / experts; twice that covers the busiest expert
    of an even routing (16 experts at 150 rows: mean 56, the 128-row tile), so its weights would
    stream once, not once per 16 rows. bench_quant sweeps around it."""
    want = min(tokens, 2 * -(-pairs // experts))
    return next((bm for bm in _DECODE_BLOCK_M if want <= bm), _DECODE_BLOCK_M[-1])


def moe_block_m(tokens: int, pairs: int, experts: int, fmt: str = "mxfp4") -> int:
    """The engine's decode row tile: the fitting one, capped at the largest measured faster for the
    format (MOE_BLOCK_M_MAX: past it the tile's accumulators cost more than the re-reads they save).
    A CUDA graph fixes the tile per batch size."""
    return min(moe_fit_block_m(tokens, pairs, experts), MOE_BLOCK_M_MAX[fmt])


def moe_used_tiles(pairs: int, experts: int, block_m: int) -> int:
    """About how many row tiles a step fills: one per expert hit (at most min(pairs, experts)) plus
    the rows past the first tile of each; the alignment allocates more (kernels/fused_moe_align.py)."""
    return min(pairs, experts) + pairs // block_m


def moe_split_k(cfg: dict, programs: int, k_blocks: int) -> int:
    """K splits of one MoE GEMM: the config's "SPLIT_K" if set, else enough that the used tiles fill
    about MOE_WAVES programs per SM (a decode step with few rows has a few hundred (tile, N tile)
    programs, one per SM, each streaming its whole K: the SMs wait on latency, not bandwidth), a
    power of two, each split at least two K steps."""
    if cfg.get("SPLIT_K"):
        return max(1, min(cfg["SPLIT_K"], k_blocks))
    want, s = MOE_WAVES * SMS, 1
    while s * programs < want and 4 * s <= k_blocks:
        s *= 2
    return s


MOE_WAVES = 4

# (stored format: "dense" | "fp8" | "mxfp4") -> decode tiles by BLOCK_M, or prefill [(max pairs, {"gate_up":
# config, "down": config}), ...] ascending (None: any count). MXFP4 "MX": "bf16" the integer e2m1 -> bf16 decode,
# "scaled" tl.dot_scaled, "e4m3" the e4m3 bit placement (kernels/fused_dequant.py). The 32- to 128-row decode
# tiles: the widest that keep both gate/up accumulators in registers (BLOCK_N x BLOCK_M x 2 float32 over the
# warps); which of them the engine picks: moe_block_m. Measured: kernels/configs/moe,device_name=NVIDIA_H200.json.
_MOE_PRE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}  # prefill, unmeasured formats


def _both(cfg: dict) -> dict:
    return {"gate_up": cfg, "down": cfg}


def _measured_moe() -> tuple[dict, dict]:
    """(decode, prefill) per format from kernels/configs/moe,device_name=NVIDIA_H200.json."""
    table = tuned_configs.load("moe")
    decode = {fmt: {int(bm): cfg for bm, cfg in tiles.items()} for fmt, tiles in table["decode"].items()}
    prefill = {fmt: [(bound, _both(cfg)) for bound, cfg in rows] for fmt, rows in table["prefill"].items()}
    return decode, prefill


_MEASURED_DECODE, _MEASURED_PREFILL = _measured_moe()
# bf16 experts (no sweep case): FP8's tiles
MOE_DECODE: dict = {"dense": _MEASURED_DECODE["fp8"], **_MEASURED_DECODE}
MOE_PREFILL: dict = {"dense": [(None, _both(_MOE_PRE))], "fp8": [(None, _both(_MOE_PRE))], **_MEASURED_PREFILL}
_DECODE_BLOCK_M = sorted(set.intersection(*(set(tiles) for tiles in MOE_DECODE.values())))  # every format has these

# Prefill MoE through bf16-unpacked experts and torch's grouped GEMM (kernels/moe_grouped.py) once the
# experts average this many rows per call, per stored format and expert count: unpacking costs a pass over the
# experts' bytes that the rows must repay (none for bf16 experts). Any expert count: the unpacked weights go
# through in chunks of experts within MOE_GROUPED_MAX_BYTES, the scratch that lives in the engine's 2 GiB
# activation reserve (engine/llm_engine.py), one weight at a time (16 MXFP4 experts: 256 MiB a weight, one
# chunk; 32, one rank's share of V4-Flash at 8-way expert parallelism: 512 MiB, one chunk; all 256 on one GPU:
# 4 GiB, 8 chunks).
# Entries: (expert count, rows per expert) ascending; a call takes the entry of the largest count <= its experts
# (below the first, the first's); rows None: the grouped path never wins there. Written from the fit of suites
# moe_dispatch / moe_prefill_tiles (tools/bench_moe_prefill.py --rows-per-expert, which prints the entry). MXFP4,
# against MOE_PREFILL_FRAG's tile from MOE_FRAG_MIN_ROWS (docs/perf/h100-2026-12-07d/moe_prefill_tiles.json, H100):
# the fused tile 1.03-1.26x the grouped path at 192-256 rows per expert at 16-256 experts and at 384 at 256
# experts; the grouped path 1.05-1.17x it from 384 (16-128 experts) and at 512 (256). FP8's is the MXFP4 value of
# before the frag tile (160), bf16 experts' reasoned (the grouped GEMM reads them as stored, no unpack to repay).
MOE_GROUPED_MIN_ROWS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "dense": ((1, 32),),
    "fp8": ((1, 160),),
    "mxfp4": ((16, 384), (64, 384), (128, 384), (256, 512)),
}
# MXFP4 prefill from this many rows per expert on: a 128 x 128 tile of 8 warps with 128-wide K steps decoding the
# weights straight into the MMA's operand registers ("bf16-frag", kernels/fused_dequant.py) instead of the table's
# tiles: 1.12-1.39x them at 96-256 rows per expert at 64-256 experts (suite moe_prefill_tiles, H100, 2026-12-07,
# docs/perf/h100-2026-12-07d/); at 16 experts 1.00x at 96, 0.88x at 128, 1.17-1.19x at 192-256; 0.99-1.01x at 64.
MOE_FRAG_MIN_ROWS = 96
MOE_PREFILL_FRAG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "MX": "bf16-frag"}
MOE_GROUPED_MAX_BYTES = 512 << 20


def moe_grouped_min_rows(experts: int, fmt: str) -> int | None:
    """MOE_GROUPED_MIN_ROWS' rows per expert for a call over `experts` experts (None: never grouped)."""
    table = MOE_GROUPED_MIN_ROWS[fmt]
    return next((rows for count, rows in reversed(table) if experts >= count), table[0][1])


def moe_grouped(pairs: int, experts: int, fmt: str) -> bool:
    """Whether a MoE call of `pairs` (token, expert) pairs takes the grouped-GEMM path: a prefill-sized call
    (past the decode tiles) whose experts average moe_grouped_min_rows' rows."""
    rows = moe_grouped_min_rows(experts, fmt)
    return rows is not None and pairs > MOE_DECODE_MAX_PAIRS and pairs >= rows * experts


# V4's FP8 linears run as cuBLAS's blockwise FP8 GEMM from this many rows (kernels/fused_fp8_linear.py): faster
# than the table's pick for all four V4 linears at 256-2048 rows, not for wq_a at 128 (tools/bench_fp8_vs_bf16.py
# --only v4, docs/perf/h200-2026-12-03-s10/fp8_cublas.json)
FP8_CUBLAS_MIN_ROWS = 256
FP8_CUBLAS_MID_ROWS = 128  # kernel variant fp8_cublas_mid's bound (a decode batch of 128 and more)

INTERPRET_LINEAR = {"dequant": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2},
                    "gemv": {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2},
                    "mma": {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 2}}
INTERPRET_MOE = {"BLOCK_N": 32, "BLOCK_K": 64}  # BLOCK_M stays the chosen one: the tests cover every row tile


def fp8_linear_config(m: int, n: int, k: int) -> dict:
    for max_rows, cfg in FP8_LINEAR.get((n, k), FP8_LINEAR["default"]):
        if max_rows is None or m <= max_rows:
            return cfg
    raise AssertionError("every FP8_LINEAR list ends with a None row bound")


def moe_config(tokens: int, pairs: int, experts: int, fmt: str) -> dict:
    """{"gate_up": config, "down": config} for one MoE call; both share BLOCK_M (one alignment)."""
    if pairs <= MOE_DECODE_MAX_PAIRS:
        return _both(MOE_DECODE[fmt][moe_block_m(tokens, pairs, experts, fmt)])
    if fmt == "mxfp4" and pairs >= MOE_FRAG_MIN_ROWS * experts:
        return _both(MOE_PREFILL_FRAG)
    for max_pairs, cfg in MOE_PREFILL[fmt]:
        if max_pairs is None or pairs <= max_pairs:
            return cfg
    raise AssertionError("every MOE_PREFILL list ends with a None pair bound")
