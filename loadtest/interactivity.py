"""Throughput against interactivity, as InferenceMAX plots it and targets quote it ("5.3x at
a fixed 150 tok/s per user"): one point per concurrency level of a sweep (loadtest.sweep's JSON),

- x: tok/s per user = 1000 / mean TPOT (ms), TPOT being each request's decode time over its
  output tokens after the first (1 / mean ITL when every delta carries one token);
- y: output tok/s per GPU = the level's output tok/s / the GPUs serving it (the sweep's `gpus`).

`at(points, x)` interpolates a curve at a fixed interactivity: linearly between the two levels
around it (more users: less interactivity, more throughput), None outside the measured range.
`compare(optimized, baseline, x)` gives both and their ratio; where the baseline never reaches x,
at the baseline's best interactivity instead, and says so; where every optimized
level is more interactive than that, the optimized one's best throughput among them (a lower bound).

    python -m loadtest.interactivity OPTIMIZED.json BASELINE.json [--at 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def tok_per_s_per_user(level: dict) -> float | None:
    mean = (level.get("tpot_ms") or {}).get("mean")
    return 1000.0 / mean if mean else None


def curve(sweep: dict) -> list[dict]:
    """The sweep's points, in concurrency order: {concurrency, tok_per_s_per_user, output_tok_per_s_per_gpu}."""
    gpus = sweep.get("gpus") or 1
    points = []
    for lv in sweep["levels"]:
        x = tok_per_s_per_user(lv)
        if x is None or lv.get("failure"):
            continue
        points.append({"concurrency": lv["concurrency"], "tok_per_s_per_user": x,
                       "output_tok_per_s_per_gpu": lv["output_tok_per_s"] / gpus})
    return points


def at(points: list[dict], x: float) -> float | None:
    """Output tok/s per GPU at `x` tok/s per user, interpolated between the two points around it."""
    pts = sorted((p["tok_per_s_per_user"], p["output_tok_per_s_per_gpu"]) for p in points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if pts and any(px == x for px, _ in pts):  # a single point exactly there
        return next(py for px, py in pts if px == x)
    return None


def compare(optimized: dict, baseline: dict, x: float) -> dict:
    """Both sweeps' throughput per GPU at `x` tok/s per user and the ratio optimized / baseline."""
    opt, base = curve(optimized), curve(baseline)
    where, note = x, None
    best = max((p["tok_per_s_per_user"] for p in base), default=None)
    if best is not None and best < x:
        where, note = best, f"the baseline never reaches {x:g} tok/s per user (best {best:.1f}): compared there"
    y_opt, y_base = at(opt, where), at(base, where)
    above = [p for p in opt if p["tok_per_s_per_user"] >= where]
    if y_opt is None and above:
        # every optimized level is more interactive than `where`: its best there serves at least
        # `where` tok/s per user, so the ratio is a lower bound (more users would only add throughput)
        top = max(above, key=lambda p: p["output_tok_per_s_per_gpu"])
        y_opt = top["output_tok_per_s_per_gpu"]
        note = (note + "; " if note else "") + (
            f"the optimized sweep stays above {where:.1f} tok/s per user: its best level there (c={top['concurrency']}, "
            f"{top['tok_per_s_per_user']:.1f} tok/s per user) taken, so the ratio is a lower bound")
    elif y_opt is None:
        note = (note + "; " if note else "") + f"the optimized sweep does not cover {where:.1f} tok/s per user"
    return {"target_tok_per_s_per_user": x, "at_tok_per_s_per_user": where,
            "optimized": {"label": optimized.get("label"), "output_tok_per_s_per_gpu": y_opt},
            "baseline": {"label": baseline.get("label"), "output_tok_per_s_per_gpu": y_base},
            "ratio": y_opt / y_base if y_opt is not None and y_base else None, "note": note}


def describe(result: dict) -> str:
    o, b = result["optimized"], result["baseline"]
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"
    line = (f"at {result['at_tok_per_s_per_user']:.1f} tok/s per user: {o['label']} {fmt(o['output_tok_per_s_per_gpu'])} "
            f"vs {b['label']} {fmt(b['output_tok_per_s_per_gpu'])} output tok/s per GPU")
    line += f" -> {result['ratio']:.2f}x" if result["ratio"] is not None else " -> no ratio"
    return line + (f" ({result['note']})" if result["note"] else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.interactivity", description=__doc__.split("\n\n")[0])
    p.add_argument("optimized", help="loadtest.sweep JSON of the configuration under test")
    p.add_argument("baseline", help="loadtest.sweep JSON it is compared with")
    p.add_argument("--at", type=float, default=150.0, help="tok/s per user to compare at (default 150)")
    p.add_argument("--json", help="write the comparison here")
    args = p.parse_args(argv)
    try:
        sweeps = [json.loads(Path(path).read_text()) for path in (args.optimized, args.baseline)]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for s in sweeps:
        print(f"{s.get('label')} ({s.get('gpus') or 1} GPU):")
        for pt in curve(s):
            print(f"  c={pt['concurrency']:<4} {pt['tok_per_s_per_user']:8.1f} tok/s per user "
                  f"{pt['output_tok_per_s_per_gpu']:10.1f} output tok/s per GPU")
    result = compare(*sweeps, args.at)
    print(describe(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
