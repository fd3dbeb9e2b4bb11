"""Tuned launch tables as data: kernels/configs/<op>,device_name=<GPU>.json, written by the sweep that measured
them (tools/bench_quant.py --write-configs merges its winners in), each naming that measurement in "measured_by".

fp8_linear: {"measured_by": {"tiles": ..., "gemv": ...}, "shapes": {"NxK": [[max rows or null, config], ...]}}
(ascending; a "gemv" row was measured by measured_by["gemv"], every other row by measured_by["tiles"]).
moe: {"measured_by": {"decode": ..., "prefill": ...}, "decode": {format: {BLOCK_M: config}},
"prefill": {format: [[max (token, expert) pairs or null, config], ...]}}.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
TUNED_DEVICE = "NVIDIA_H200"  # the one GPU the tables were measured on; they serve every device (and the interpreter)
# bench_quant's swept row counts -> the rows each winner serves up to (None: any count)
ROW_BOUNDS = {1: 16, 32: 64, 150: 512, 2048: 4096, 8192: None}


def config_path(op: str, device_name: str = TUNED_DEVICE) -> Path:
    return CONFIG_DIR / f"{op},device_name={device_name}.json"


@functools.cache
def load(op: str) -> dict:
    """The table as stored; read once (callers copy what they keep)."""
    return json.loads(config_path(op).read_text())


def _save(op: str, table: dict) -> Path:
    path = config_path(op)
    path.write_text(json.dumps(table, indent=1) + "\n")
    load.cache_clear()
    return path


def _bounded(rows: list, bound: int | None, config: dict) -> list:
    """`rows` with the entry at `bound` replaced (or added), ascending, None last."""
    kept = [r for r in rows if r[0] != bound] + [[bound, config]]
    return sorted(kept, key=lambda r: (r[0] is None, r[0] or 0))


def merge_sweep(results: list[dict], measured_by: str, top_k: int) -> list[Path]:
    """Merge tools/bench_quant.py's winners ("best" of each result row) into the tables: an FP8 linear's
    winner at a swept row count replaces that shape's row at ROW_BOUNDS' bound (rows it did not sweep, such
    as a one-row "gemv", stay); a MoE decode winner replaces the tile of its BLOCK_M, a prefill winner the
    entry at its row bound times top_k pairs. Returns the files written."""
    lin, moe = json.loads(json.dumps(load("fp8_linear"))), json.loads(json.dumps(load("moe")))
    wrote_lin = wrote_dec = wrote_pre = False
    for r in results:
        if "best" not in r or r["rows"] not in ROW_BOUNDS:
            continue
        bound = ROW_BOUNDS[r["rows"]]
        if r["op"] == "fp8_linear":
            if r.get("block", 128) != 128:
                raise ValueError("the FP8 linear table holds 128x128-block weights' tiles only")
            key = f"{r['n']}x{r['k']}"
            lin["shapes"][key] = _bounded(lin["shapes"].get(key, []), bound, r["best"])
            wrote_lin = True
        elif r["op"] == "moe":
            cfg = r["best"]["gate_up"]
            if r["rows"] * top_k <= _decode_max_pairs():
                moe["decode"].setdefault(r["fmt"], {})[str(cfg["BLOCK_M"])] = cfg
                wrote_dec = True
            else:
                pairs = None if bound is None else bound * top_k
                moe["prefill"][r["fmt"]] = _bounded(moe["prefill"].get(r["fmt"], []), pairs, cfg)
                wrote_pre = True
    paths = []
    if wrote_lin:
        lin["measured_by"]["tiles"] = measured_by
        paths.append(_save("fp8_linear", lin))
    if wrote_dec or wrote_pre:
        moe["measured_by"].update({"decode": measured_by} if wrote_dec else {})
        moe["measured_by"].update({"prefill": measured_by} if wrote_pre else {})
        paths.append(_save("moe", moe))
    return paths


def _decode_max_pairs() -> int:
    from kernels import quant_configs

    return quant_configs.MOE_DECODE_MAX_PAIRS
