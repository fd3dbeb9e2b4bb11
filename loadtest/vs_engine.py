"""Serving against the engine alone, level by level: a loadtest.sweep through Triton, the same
engine called directly (tools.bench_engine's online JSON, `--core-process`), and/or a sweep
through the OpenAI front. Prints the ratio table the `serving_vs_*` suites answer with.

    python -m loadtest.vs_engine TRITON.json [ENGINE.json] [--openai OPENAI.json] [--json out.json]

A level whose load generator was the limit (loadtest.saturation) is marked: its ratio describes
the clients, not the server. So is a ratio whose two runs counted throughput differently (the
"counted" column): a sweep counts the tokens inside its window (loadtest.window: --duration,
--warmup); engine-direct does too with --duration, but with --requests-per-user it divides all
output tokens by the time until the last request finished ("drain"), which at long requests
differs by tens of percent. Missing inputs (a step that failed) leave their columns empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadtest.window import describe


def sweep_levels(path: str | None) -> dict[int, dict]:
    """concurrency -> {tok_s, ttft_p50, itl_p50, e2e_p50, client_bound} of a loadtest.sweep JSON."""
    if not path or not Path(path).exists():
        return {}
    levels = {}
    sweep = json.loads(Path(path).read_text())
    counted = describe(sweep["duration_s"], sweep.get("warmup_s", 0.0))
    for lv in sweep["levels"]:
        if lv.get("failure"):
            continue
        levels[lv["concurrency"]] = {"tok_s": lv["output_tok_per_s"], "ttft_p50": lv["ttft_ms"].get("p50"),
                                     "itl_p50": lv["itl_ms"].get("p50"), "e2e_p50": lv["e2e_ms"].get("p50"),
                                     "client_bound": bool(lv.get("client_bound")), "counted": counted}
    return levels


def engine_levels(path: str | None) -> dict[int, dict]:
    """The same from tools.bench_engine's JSON (its online results)."""
    if not path or not Path(path).exists():
        return {}
    levels = {}
    for r in json.loads(Path(path).read_text())["results"]:
        if r["mode"] != "online":
            continue
        window = r.get("window") or {}
        counted = describe(window["duration_s"], window["warmup_s"]) if r.get("accounting") == "window" else "drain"
        levels[r["concurrency"]] = {"tok_s": r["output_tok_s"], "ttft_p50": r["ttft_ms"].get("p50"),
                                    "itl_p50": r["itl_ms"].get("p50"), "e2e_p50": r["e2e_ms"].get("p50"),
                                    "client_bound": bool((r.get("saturation") or {}).get("client_bound")),
                                    "counted": counted}
    return levels


def ratio(a: dict | None, b: dict | None) -> float | None:
    return a["tok_s"] / b["tok_s"] if a and b and b["tok_s"] else None


def counted_apart(pairs: list[tuple[str, dict | None, str, dict | None]]) -> list[str]:
    """The ratios of a row whose two runs counted throughput differently, e.g. "engine drain / triton
    window 0+30 s"."""
    return [f"{na} {a['counted']} / {nb} {b['counted']}" for na, a, nb, b in pairs
            if a and b and a["counted"] != b["counted"]]


def rows(triton: dict, engine: dict, openai: dict) -> list[dict]:
    out = []
    for c in sorted(set(triton) | set(engine) | set(openai)):
        t, e, o = triton.get(c), engine.get(c), openai.get(c)
        bound = [name for name, lv in (("triton", t), ("engine", e), ("openai", o)) if lv and lv["client_bound"]]
        out.append({"users": c, "engine_tok_s": e and e["tok_s"], "triton_tok_s": t and t["tok_s"],
                    "triton_vs_engine": ratio(t, e), "openai_tok_s": o and o["tok_s"], "openai_vs_triton": ratio(o, t),
                    "ttft_p50_ms": {"engine": e and e["ttft_p50"], "triton": t and t["ttft_p50"],
                                    "openai": o and o["ttft_p50"]},
                    "counted": {"engine": e and e["counted"], "triton": t and t["counted"],
                                "openai": o and o["counted"]},
                    "counted_apart": counted_apart([("triton", t, "engine", e), ("openai", o, "triton", t)]),
                    "client_bound": bound})
    return out


def table(result: list[dict]) -> str:
    f = lambda v, d=1: "-" if v is None else f"{v:,.{d}f}"
    x = lambda v: "-" if v is None else f"{v:.2f}x"
    lines = ["| users | engine-direct tok/s | Triton tok/s | Triton / engine | OpenAI tok/s | OpenAI / Triton | "
             "TTFT p50 ms engine / Triton / OpenAI | counted | client-bound |", "|" + " --- |" * 9]
    for r in result:
        ttft = r["ttft_p50_ms"]
        counted = ("DIFFERENT: " + "; ".join(r["counted_apart"]) if r["counted_apart"]
                   else " / ".join(dict.fromkeys(v for v in r["counted"].values() if v)))
        lines.append(f"| {r['users']} | {f(r['engine_tok_s'])} | {f(r['triton_tok_s'])} | {x(r['triton_vs_engine'])} | "
                     f"{f(r['openai_tok_s'])} | {x(r['openai_vs_triton'])} | {f(ttft['engine'])} / {f(ttft['triton'])} / "
                     f"{f(ttft['openai'])} | {counted} | {', '.join(r['client_bound']) or 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.vs_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("triton", help="loadtest.sweep JSON through Triton")
    p.add_argument("engine", nargs="?", default=None, help="tools.bench_engine JSON (online, --core-process)")
    p.add_argument("--openai", default=None, help="loadtest.sweep JSON through the OpenAI front")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    triton, engine, openai = sweep_levels(args.triton), engine_levels(args.engine), sweep_levels(args.openai)
    if not triton or not (engine or openai):
        print(f"error: need a Triton sweep ({args.triton}) and an engine-direct run ({args.engine}) or an OpenAI "
              f"sweep ({args.openai})", file=sys.stderr)
        return 1
    result = rows(triton, engine, openai)
    print(table(result))
    if any(r["counted_apart"] for r in result):
        print("warning: a ratio marked DIFFERENT compares runs that counted throughput differently (see "
              "docs/LOADTEST.md, \"What a ratio compares\"); rerun engine-direct with the sweep's --duration and --warmup")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
