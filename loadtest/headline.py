"""The headline serving table (docs/PERF.md): one closed-loop curve level by level, then read at
fixed tok/s per user (loadtest.interactivity.read: between two levels, or the bound it can give).

    python -m loadtest.headline out/depth-1k-low.json [out/depth-1k-high.json ...] [--at 20,50] [--json t.json]

Several sweeps of one workload against one server configuration (a curve split over device calls)
make one curve; sweeps that differ in either are refused. Per level: output tok/s, per GPU, tok/s
per user, TTFT p50 / p90, ITL p50, E2E p50, the server's prefix-cache hit ratio, and its flags:
client-bound (loadtest.saturation: the load generator set the figures), a short window (under
SHORT_WINDOW E2E p50s: the level measured its cold start's burst more than a steady state), failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadtest import interactivity
from loadtest.report import load, workload_shape

SHORT_WINDOW = 2.0  # a window under this many E2E p50s holds fewer than ~2 requests per user


def same_curve_key(sweep: dict) -> dict:
    """What sweeps must share to be one curve: the load and the server they measured."""
    server = sweep.get("server") or {}
    return {"workload": sweep.get("workload"), "protocol": sweep.get("protocol"), "gpus": sweep.get("gpus") or 1,
            "model": server.get("model"), "engine_args": server.get("engine_args")}


def merge(sweeps: list[dict]) -> dict:
    """One sweep-shaped curve from sweeps of one workload and server: their levels in user order."""
    if not sweeps:
        raise ValueError("no sweep given")
    key = same_curve_key(sweeps[0])
    for s in sweeps[1:]:
        other = same_curve_key(s)
        diff = sorted(k for k in key if key[k] != other[k])
        if diff:
            raise ValueError(f"{s.get('label')} is not on {sweeps[0].get('label')}'s curve: its {', '.join(diff)} "
                             "differ (loadtest.interactivity compares two configurations)")
    levels = sorted((lv for s in sweeps for lv in s["levels"]), key=lambda lv: lv["concurrency"])
    users = [lv["concurrency"] for lv in levels]
    twice = sorted({u for u in users if users.count(u) > 1})
    if twice:
        raise ValueError(f"users {twice} measured by more than one sweep: keep one")
    return {"labels": [s.get("label") for s in sweeps], **key, "levels": levels}


def flags(level: dict) -> list[str]:
    if level.get("failure"):
        return ["FAILED: " + level["failure"]]
    out = ["client-bound"] if level.get("client_bound") else []
    e2e = (level.get("e2e_ms") or {}).get("p50")
    if e2e and level["window_s"] < SHORT_WINDOW * e2e / 1e3:
        out.append(f"short window ({level['window_s']:.0f} s, E2E p50 {e2e / 1e3:.1f} s)")
    return out


def row(level: dict) -> dict:
    ms = lambda metric, p: (level.get(metric) or {}).get(p)
    return {"users": level["concurrency"], "output_tok_per_s": level.get("output_tok_per_s"),
            "output_tok_per_s_per_gpu": level.get("output_tok_per_s_per_gpu"),
            "tok_per_s_per_user": interactivity.tok_per_s_per_user(level),
            "ttft_p50_ms": ms("ttft_ms", "p50"), "ttft_p90_ms": ms("ttft_ms", "p90"), "itl_p50_ms": ms("itl_ms", "p50"),
            "e2e_p50_ms": ms("e2e_ms", "p50"), "prefix_hit_ratio": (level.get("server") or {}).get("prefix_hit_ratio"),
            # a string, and before the counts: benchmarks' report shows a row's scalars, its first 12 columns
            "flags": "; ".join(flags(level)), "requests": level.get("requests"), "window_s": level.get("window_s"),
            "client_bound": bool(level.get("client_bound"))}


def headline(sweeps: list[dict], points: list[float]) -> dict:
    """The table's rows and the curve's readings at `points` tok/s per user."""
    curve = merge(sweeps)
    readings = [interactivity.read(interactivity.curve(curve), x) for x in points]
    return {**curve, "rows": [row(lv) for lv in curve["levels"]], "at": readings}


def table(result: dict) -> str:
    f = lambda v, d=1: "-" if v is None else f"{v:,.{d}f}"
    lines = [f"{', '.join(result['labels'])}: {result['workload']['kind']}, {workload_shape(result['workload'])}, "
             f"{result['protocol']}, {result['gpus']} GPU", "",
             "| users | output tok/s | per GPU | tok/s per user | TTFT p50 / p90 ms | ITL p50 ms | E2E p50 ms | "
             "prefix hit | flags |", "|" + " --- |" * 9]
    for r in result["rows"]:
        hit = "-" if r["prefix_hit_ratio"] is None else f"{100 * r['prefix_hit_ratio']:.0f}%"
        lines.append(f"| {r['users']} | {f(r['output_tok_per_s'])} | {f(r['output_tok_per_s_per_gpu'])} | "
                     f"{f(r['tok_per_s_per_user'])} | {f(r['ttft_p50_ms'], 0)} / {f(r['ttft_p90_ms'], 0)} | "
                     f"{f(r['itl_p50_ms'])} | {f(r['e2e_p50_ms'], 0)} | {hit} | {r['flags'] or '-'} |")
    lines += [""] + ["- " + interactivity.describe_reading(r) for r in result["at"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.headline", description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="loadtest.sweep JSON files of one workload and server")
    p.add_argument("--at", type=interactivity.parse_points, default=[20.0, 50.0], metavar="X[,X...]",
                   help="tok/s per user to read the curve at (default 20,50)")
    p.add_argument("--json", help="write the rows and the readings here")
    args = p.parse_args(argv)
    try:
        result = headline(load(args.sweeps), args.at)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items() if k != "levels"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
