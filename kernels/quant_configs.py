"""The launch configuration of every quantized kernel, per shape: the one dispatch table.

tools/bench_quant.py sweeps candidates on the H200 and prints its winners in this table's form
(JSON key "best"); paste them here. Until then the entries are the reasoned defaults:
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
FP8_LINEAR: dict = {
    "default": [(16, _DECODE), (64, {**_DECODE, "BLOCK_M": 64}), (512, _MID), (None, _PREFILL)],
}

MOE_DECODE_MAX_PAIRS = 1024  # (token, expert) pairs up to which the decode kernels run (150 rows x top-6)
# (phase, stored format: "dense" | "fp8" | "mxfp4") -> {"gate_up": config, "down": config}
_MOE_DEC = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
_MOE_PRE = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
MOE: dict = {
    ("decode", "dense"): {"gate_up": _MOE_DEC, "down": _MOE_DEC},
    ("decode", "fp8"): {"gate_up": _MOE_DEC, "down": _MOE_DEC},
    ("decode", "mxfp4"): {"gate_up": {**_MOE_DEC, "BLOCK_K": 256}, "down": {**_MOE_DEC, "BLOCK_K": 256}},
    ("prefill", "dense"): {"gate_up": _MOE_PRE, "down": _MOE_PRE},
    ("prefill", "fp8"): {"gate_up": _MOE_PRE, "down": _MOE_PRE},
    ("prefill", "mxfp4"): {"gate_up": _MOE_PRE, "down": _MOE_PRE},
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
    return MOE[("decode" if pairs <= MOE_DECODE_MAX_PAIRS else "prefill", fmt)]
