"""Throughput against interactivity, as InferenceMAX plots it and targets quote it ("5.3x at
a fixed 150 tok/s per user"): one point per concurrency level of a sweep (loadtest.sweep's JSON),

- x: tok/s per user = 1000 / mean TPOT (ms), TPOT being each request's decode time over its
  output tokens after the first (1 / mean ITL when every delta carries one token);
- y: output tok/s per GPU = the level's output tok/s / the GPUs serving it (the sweep's `gpus`).

`at(points, x)` interpolates a curve at a fixed interactivity: linearly between the two levels
around it (more users: less interactivity, more throughput), None outside the measured range.
`read(points, x)` is the one reading of a curve at x the tools report: `at`'s value, or outside the
range, a lower bound where every level is more interactive than x (the best throughput among them:
more users would only trade interactivity for throughput) and nothing where every level is less
interactive, with a note saying which. `compare(optimized, baseline, x)` gives both and their ratio;
where the baseline never reaches x, at the baseline's best interactivity instead, and says so.

    python -m loadtest.interactivity SWEEP.json [BASELINE.json] [--at 20,50] [--json out.json]

One sweep: its curve read at each point of --at; with a baseline: the two compared at each.
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


def read(points: list[dict], x: float) -> dict:
    """The curve at `x` tok/s per user: {tok_per_s_per_user, output_tok_per_s_per_gpu, lower_bound, note};
    the note (None inside the measured range) says what was taken and why outside it."""
    y = at(points, x)
    reading = {"tok_per_s_per_user": x, "output_tok_per_s_per_gpu": y, "lower_bound": False, "note": None}
    if y is not None:
        return reading
    if not points:
        return reading | {"note": "no level measured"}
    slowest = min(points, key=lambda p: p["tok_per_s_per_user"])
    if slowest["tok_per_s_per_user"] > x:
        # every level serves more than x tok/s per user: the best of them serves at least x, so x
        # gets at least its throughput (more users would only add throughput)
        top = max(points, key=lambda p: p["output_tok_per_s_per_gpu"])
        return reading | {"output_tok_per_s_per_gpu": top["output_tok_per_s_per_gpu"], "lower_bound": True,
                          "note": f"every level is above {x:g} tok/s per user (the least interactive: "
                                  f"c={slowest['concurrency']}, {slowest['tok_per_s_per_user']:.1f}): the best "
                                  f"level there (c={top['concurrency']}, {top['tok_per_s_per_user']:.1f} tok/s "
                                  "per user) taken, a lower bound"}
    fastest = max(points, key=lambda p: p["tok_per_s_per_user"])
    return reading | {"note": f"the sweep does not cover {x:g} tok/s per user (its most interactive level: "
                              f"c={fastest['concurrency']}, {fastest['tok_per_s_per_user']:.1f})"}


def compare(optimized: dict, baseline: dict, x: float) -> dict:
    """Both sweeps' throughput per GPU at `x` tok/s per user and the ratio optimized / baseline."""
    opt, base = curve(optimized), curve(baseline)
    where, notes = x, []
    best = max((p["tok_per_s_per_user"] for p in base), default=None)
    if best is not None and best < x:
        where = best
        notes.append(f"the baseline never reaches {x:g} tok/s per user (best {best:.1f}): compared there")
    reading, y_base = read(opt, where), at(base, where)
    y_opt = reading["output_tok_per_s_per_gpu"]
    if reading["note"]:
        notes.append("optimized: " + reading["note"] + (" (so is the ratio)" if reading["lower_bound"] else ""))
    return {"target_tok_per_s_per_user": x, "at_tok_per_s_per_user": where,
            "optimized": {"label": optimized.get("label"), "output_tok_per_s_per_gpu": y_opt},
            "baseline": {"label": baseline.get("label"), "output_tok_per_s_per_gpu": y_base},
            "ratio": y_opt / y_base if y_opt is not None and y_base else None, "note": "; ".join(notes) or None}


def describe(result: dict) -> str:
    o, b = result["optimized"], result["baseline"]
    line = (f"at {result['at_tok_per_s_per_user']:.1f} tok/s per user: {o['label']} {_fmt(o['output_tok_per_s_per_gpu'])} "
            f"vs {b['label']} {_fmt(b['output_tok_per_s_per_gpu'])} output tok/s per GPU")
    line += f" -> {result['ratio']:.2f}x" if result["ratio"] is not None else " -> no ratio"
    return line + (f" ({result['note']})" if result["note"] else "")


def describe_reading(reading: dict) -> str:
    value = _fmt(reading["output_tok_per_s_per_gpu"])
    line = f"at {reading['tok_per_s_per_user']:g} tok/s per user: {'>= ' if reading['lower_bound'] else ''}{value} " \
           "output tok/s per GPU"
    return line + (f" ({reading['note']})" if reading["note"] else "")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def parse_points(text: str) -> list[float]:
    """`--at`: tok/s per user, comma-separated ("20,50"), each > 0."""
    try:
        points = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r} (e.g. 20,50)") from None
    if not points or min(points) <= 0:
        raise argparse.ArgumentTypeError(f"tok/s per user must be numbers > 0: {text!r}")
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.interactivity", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="loadtest.sweep JSON: the curve read, or the configuration under test")
    p.add_argument("baseline", nargs="?", default=None, help="loadtest.sweep JSON the sweep is compared with")
    p.add_argument("--at", type=parse_points, default=[150.0], metavar="X[,X...]",
                   help="tok/s per user to read (or compare) at, comma-separated (default 150)")
    p.add_argument("--json", help="write the curves and the readings (or comparisons) here")
    args = p.parse_args(argv)
    try:
        sweeps = [json.loads(Path(path).read_text()) for path in (args.sweep, args.baseline) if path]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    curves = [{"label": s.get("label"), "gpus": s.get("gpus") or 1, "points": curve(s)} for s in sweeps]
    for c in curves:
        print(f"{c['label']} ({c['gpus']} GPU):")
        for pt in c["points"]:
            print(f"  c={pt['concurrency']:<4} {pt['tok_per_s_per_user']:8.1f} tok/s per user "
                  f"{pt['output_tok_per_s_per_gpu']:10.1f} output tok/s per GPU")
    if args.baseline:
        results = [compare(*sweeps, x) for x in args.at]
        lines = [describe(r) for r in results]
    else:
        results = [read(curves[0]["points"], x) for x in args.at]
        lines = [describe_reading(r) for r in results]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"curves": curves, "at": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
