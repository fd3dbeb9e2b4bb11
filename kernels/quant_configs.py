"""The launch configuration of every quantized kernel, per shape: the one dispatch table.

tools/bench_quant.py sweeps candidates on the H200 and prints its winners in this table's form
(JSON key "best"); paste them here (the measured ones are marked below). Otherwise the reasoned defaults:
- FP8 linear, decode (<= 64 rows): "dequant" streams the weight with many programs (narrow N
  tiles times split-K, so all 132 SMs read), swap-AB (weight rows on the MMA's M side).
- FP8 linear, from a few hundred rows: "mma", activations quantized once, 128x128 FP8 tiles.
- MoE, decode (pairs <= MOE_DECODE_MAX_PAIRS): one program per (expert hit, N tile), reading
  only the routed experts; prefill: experts sorted and padded to 64-row tiles (BLOCK_M, when
  given, overrides fused_moe._row_class).
A config: variant, BLOCK_M, BLOCK_N, BLOCK_K (dequant), SPLIT_K (0: enough for ~2 waves of
programs), GROUP_M (mma: programs sharing weight tiles run together), num_warps, num_stages.
"""

from __future__ import annotations

SMS = 132  # H200 multiprocessors; split-K sizing only (the interpreter ignores it)

_DECODE = {"variant": "dequant", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 4,
           "num_stages": 4}
_MID = {"variant": "mma", "BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
_PREFILL = {"variant": "mma", "BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}

# (N, K) or "default" -> [(max rows, config), ...] ascending; None: any row count.
# Measured entries: H200 2026-12-01 (docs/perf/h200-2026-12-01-s4/quant_tuned.json "best"), at
# rows 1 / 32 / 150 / 2048 / 8192; each serves the rows up to the bound beside it (16 / 64 / 512 / 4096 / any).
def _dq(bm: int, bn: int, st: int = 4, w: int = 4) -> dict:
    return {"variant": "dequant", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": w,
            "num_stages": st}


def _mm(bm: int, bn: int, w: int = 4, st: int = 4) -> dict:
    return {"variant": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st}


FP8_LINEAR: dict = {
    "default": [(16, _DECODE), (64, {**_DECODE, "BLOCK_M": 64}), (512, _MID), (None, _PREFILL)],
    (1024, 4096): [(16, _dq(16, 64)), (64, _dq(32, 32)), (512, _dq(64, 64)), (4096, _mm(128, 128, 8, 3)),
                   (None, _mm(128, 64))],
    (32768, 1024): [(16, _mm(64, 128)), (64, _mm(64, 128)), (512, _mm(64, 128)), (4096, _mm(128, 128, 8, 3)),
                    (None, _mm(64, 128))],
    (4096, 8192): [(16, _dq(16, 128, st=3)), (64, _dq(32, 64)), (512, _mm(64, 64)), (4096, _mm(128, 128, 8, 3)),
                   (None, _mm(128, 64))],
    (2048, 4096): [(16, _dq(16, 64)), (64, _dq(32, 128, w=8)), (512, _dq(64, 128, st=3)),
                   (4096, _mm(128, 128, 8, 3)), (None, _mm(64, 128))],
}

MOE_DECODE_MAX_PAIRS = 1024  # (token, expert) pairs up to which the decode kernels run (150 rows x top-6)
# (phase, stored format: "dense" | "fp8" | "mxfp4") -> {"gate_up": config, "down": config}, or
# [(max pairs, that), ...] ascending (None: any count). MXFP4 "MX": "scaled" multiplies the packed
# e2m1 tile by tl.dot_scaled (Triton's PRMT-table e2m1 -> bf16 unpack and ue8m0 scale, no
# conversion-unit instructions); "e4m3": the e4m3 bit placement (kernels/fused_dequant.py).
# Measured (H200 2026-12-01, quant_tuned.json, with "e4m3"): decode n64 k128 w4 st4 for MXFP4 and
# FP8 at 1 / 32 / 150 rows; MXFP4 prefill m64 n128 k64 w8 st3 at 2048 rows, m128 n64 k128 w4 st3 at 8192.
_MOE_DEC = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
_MOE_PRE = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
# Measured again with both (quant_pass2.json): "e4m3" wins at every row count on Triton 3.6 (MXFP4 1 row
# 128 us vs 135-264 us scaled; 150 rows 4.62 ms vs 5.37-9.74 ms), so it is the default.
_MX = {"MX": "e4m3"}
MOE: dict = {
    ("decode", "dense"): {"gate_up": _MOE_DEC, "down": _MOE_DEC},
    ("decode", "fp8"): {"gate_up": _MOE_DEC, "down": _MOE_DEC},
    ("decode", "mxfp4"): {"gate_up": {**_MOE_DEC, **_MX}, "down": {**_MOE_DEC, **_MX}},
    ("prefill", "dense"): {"gate_up": _MOE_PRE, "down": _MOE_PRE},
    ("prefill", "fp8"): {"gate_up": _MOE_PRE, "down": _MOE_PRE},
    ("prefill", "mxfp4"): [
        (6143, {"gate_up": {**_MOE_PRE, **_MX}, "down": {**_MOE_PRE, **_MX}}),  # unmeasured: fused_moe._row_class tiles
        (24576, {part: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, **_MX}
                 for part in ("gate_up", "down")}),
        (None, {part: {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, **_MX}
                for part in ("gate_up", "down")}),
    ],
}

INTERPRET_LINEAR = {"dequant": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2},
                    "mma": {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 2}}
INTERPRET_MOE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}


def fp8_linear_config(m: int, n: int, k: int) -> dict:
    for max_rows, cfg in FP8_LINEAR.get((n, k), FP8_LINEAR["default"]):
        if max_rows is None or m <= max_rows:
            return cfg
    raise AssertionError("every FP8_LINEAR list ends with a None row bound")


def moe_config(pairs: int, fmt: str) -> dict:
    entry = MOE[("decode" if pairs <= MOE_DECODE_MAX_PAIRS else "prefill", fmt)]
    if isinstance(entry, dict):
        return entry
    for max_pairs, cfg in entry:
        if max_pairs is None or pairs <= max_pairs:
            return cfg
    raise AssertionError("every MOE list ends with a None pair bound")
