"""Plots and a side-by-side table from one or more sweeps (loadtest.sweep's JSON).

    python -m loadtest.report out/prefix-on.json out/prefix-off.json --out docs/loadtest

Writes throughput.png (output tok/s and request/s vs concurrency), ttft.png, itl.png (p50 solid,
p90 dashed, p99 dotted), e2e.png, interactivity.png (output tok/s per GPU against tok/s per user,
one point per level: loadtest.interactivity), and report.md: each sweep's command and settings, then
one table per figure with the configurations side by side (and their ratio when there are two, plus
the two curves compared at a fixed tok/s per user, --at, default 150). A level whose clients were
the limit (loadtest.saturation) is marked `client-bound` in every table and with a red cross in
every plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadtest import interactivity

STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def load(paths: list[str]) -> list[dict]:
    sweeps = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "levels" not in data:
            raise ValueError(f"{p}: not a loadtest.sweep result (no 'levels')")
        sweeps.append(data)
    labels = [s["label"] for s in sweeps]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two sweeps share a label: {labels}")
    return sweeps


def _series(sweep: dict, metric: str, key: str | None = None) -> tuple[list[int], list[float | None]]:
    xs, ys = [], []
    for lv in sweep["levels"]:
        value = lv.get(metric)
        if key is not None:
            value = (value or {}).get(key)
        xs.append(lv["concurrency"])
        ys.append(value)
    return xs, ys


def bound(level: dict) -> bool:
    """The level's clients were the limit (loadtest.saturation): its figures are the load generator's."""
    return bool(level.get("client_bound"))


def plot(sweeps: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    levels = sorted({lv["concurrency"] for s in sweeps for lv in s["levels"]})
    written = []

    def axis(ax, ylabel: str, title: str) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)

    def mark_bound(ax, xs: list, ys: list, levels_: list[dict]) -> None:
        """A red cross over each client-bound point, one legend entry for all."""
        pts = [(x, y) for x, y, lv in zip(xs, ys, levels_) if bound(lv) and y is not None]
        if pts:
            labelled = "client-bound" in ax.get_legend_handles_labels()[1]
            ax.plot(*zip(*pts), "x", color="red", markersize=11, markeredgewidth=2, linestyle="none",
                    label=None if labelled else "client-bound")

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(sweeps):
        for ax, metric in ((a, "output_tok_per_s"), (b, "request_per_s")):
            ax.plot(*_series(s, metric), "o-", color=colors[i % len(colors)], label=s["label"])
            mark_bound(ax, *_series(s, metric), s["levels"])
    axis(a, "output tokens / s", "Throughput (output tokens)")
    axis(b, "requests / s", "Throughput (completed requests)")
    a.set_ylim(bottom=0)
    b.set_ylim(bottom=0)
    save(fig, "throughput.png")

    for metric, name, title in (("ttft_ms", "ttft.png", "Time to first token"),
                                ("itl_ms", "itl.png", "Inter-token latency (gap between deltas)"),
                                ("e2e_ms", "e2e.png", "End-to-end request latency")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, s in enumerate(sweeps):
            for p, style in STYLES.items():
                ax.plot(*_series(s, metric, p), marker="o", markersize=3, linestyle=style,
                        color=colors[i % len(colors)], label=f"{s['label']} {p}")
            mark_bound(ax, *_series(s, metric, "p50"), s["levels"])
        axis(ax, "ms", title)
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(sweeps):
        pts = interactivity.curve(s)
        ax.plot([p["tok_per_s_per_user"] for p in pts], [p["output_tok_per_s_per_gpu"] for p in pts], "o-",
                color=colors[i % len(colors)], label=f"{s['label']} ({s.get('gpus') or 1} GPU)")
        for p in pts:
            ax.annotate(str(p["concurrency"]), (p["tok_per_s_per_user"], p["output_tok_per_s_per_gpu"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        by_c = {lv["concurrency"]: lv for lv in s["levels"]}
        mark_bound(ax, [p["tok_per_s_per_user"] for p in pts], [p["output_tok_per_s_per_gpu"] for p in pts],
                   [by_c[p["concurrency"]] for p in pts])
    ax.set_xlabel("tok/s per user (1000 / mean TPOT ms)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title("Throughput vs interactivity (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    save(fig, "interactivity.png")
    return written


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


# (title, getter, digits, higher is better)
TABLES = [
    ("Output tokens/s", lambda lv: lv["output_tok_per_s"], 1, True),
    ("Output tokens/s per GPU", lambda lv: lv.get("output_tok_per_s_per_gpu"), 1, True),
    ("Tokens/s per user (1000 / mean TPOT)", interactivity.tok_per_s_per_user, 1, True),
    ("Requests/s", lambda lv: lv["request_per_s"], 2, True),
    ("TTFT p50 (ms)", lambda lv: lv["ttft_ms"].get("p50"), 1, False),
    ("TTFT p90 (ms)", lambda lv: lv["ttft_ms"].get("p90"), 1, False),
    ("TTFT p99 (ms)", lambda lv: lv["ttft_ms"].get("p99"), 1, False),
    ("ITL p50 (ms)", lambda lv: lv["itl_ms"].get("p50"), 2, False),
    ("ITL p99 (ms)", lambda lv: lv["itl_ms"].get("p99"), 2, False),
    ("TPOT p50 (ms)", lambda lv: lv["tpot_ms"].get("p50"), 2, False),
    ("E2E p50 (ms)", lambda lv: lv["e2e_ms"].get("p50"), 1, False),
    ("E2E p99 (ms)", lambda lv: lv["e2e_ms"].get("p99"), 1, False),
    ("Error rate (%)", lambda lv: 100 * lv["error_rate"], 2, False),
    ("Prefix-cache hit ratio (%, server)",
     lambda lv: None if (lv.get("server") or {}).get("prefix_hit_ratio") is None
     else 100 * lv["server"]["prefix_hit_ratio"], 1, True),
    ("Deltas per streamed response (server; > 1: its response thread fell behind)",
     lambda lv: (lv.get("server") or {}).get("deltas_per_response"), 2, False),
    ("Draft acceptance rate (%, server; speculative decoding)",
     lambda lv: None if (lv.get("server") or {}).get("spec_acceptance_rate") is None
     else 100 * lv["server"]["spec_acceptance_rate"], 1, True),
    ("Mean acceptance length (tokens per verify step, server)",
     lambda lv: (lv.get("server") or {}).get("spec_mean_acceptance_length"), 2, True),
    ("Client CPU, busiest client process (cores; >= 0.85: client-bound)",
     lambda lv: (lv.get("saturation") or {}).get("client_cpu", {}).get("busiest_cores"), 2, False),
    ("Users busy (%, Little's law; < 85: client-bound)",
     lambda lv: None if (lv.get("saturation") or {}).get("littles_law", {}).get("busy_ratio") is None
     else 100 * lv["saturation"]["littles_law"]["busy_ratio"], 1, True),
    ("Response thread busy (%, server)",
     lambda lv: None if (lv.get("server") or {}).get("response_thread_busy") is None
     else 100 * lv["server"]["response_thread_busy"], 1, False),
]


def _load(sweep: dict) -> str:
    """The host's 1-minute load average around the levels: how busy the machine was."""
    loads = [v[0] for lv in sweep["levels"] for v in (lv.get("load_avg") or {}).values()]
    return f"; load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""


def workload_shape(w: dict) -> str:
    """A sweep's workload settings in words."""
    return {"random": f"input {w['input_len']} tokens, output {w['output_len']}",
            "agentic": f"system prompt {w['system_len']} tokens, user turns {w['turn_len']}, "
                       f"{w['turns']} turns per conversation, output {w['output_len']}",
            "prompts": f"prompts from {w['prompts_file']}, output {w['output_len']}"}[w["kind"]]


def markdown(sweeps: list[dict], pngs: list[Path] = (), at: float = 150.0) -> str:
    labels = [s["label"] for s in sweeps]
    lines = ["# Load-test report", "", *[f"![{p.stem}]({p.name})" for p in pngs], ""]
    for s in sweeps:
        w = s["workload"]
        shape = workload_shape(w)
        server = s["server"]
        engine = (f"started by the sweep, engine args `{json.dumps(server.get('engine_args') or {})}` over "
                  f"model.json's" if server.get("serve") else f"a running server at {server['url']}")
        lines += [f"## {s['label']}", "",
                  f"- command: `{s['command']}`",
                  f"- {s['protocol']} via {s.get('driver', 'locust')}, {w['kind']} workload: {shape}; "
                  f"temperature {s['sampling']['temperature']}, ignore_eos {s['sampling']['ignore_eos']}",
                  f"- server: {engine}; {s['duration_s']:g} s per level",
                  f"- host: {s['host']['platform']}, {s['host']['cpus']} CPUs; {s['started']}{_load(s)}", ""]
    levels = sorted({lv["concurrency"] for s in sweeps for lv in s["levels"]})
    by = [{lv["concurrency"]: lv for lv in s["levels"]} for s in sweeps]
    ratio = len(sweeps) == 2
    for title, get, digits, _ in TABLES:
        values = [[None if c not in b else get(b[c]) for b in by] for c in levels]
        if all(v is None for row in values for v in row):
            continue
        head = ["concurrency", *labels] + ([f"{labels[1]} / {labels[0]}"] if ratio else [])
        lines += [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c, row in zip(levels, values):
            cells = [str(c), *(_fmt(v, digits) + (" (client-bound)" if c in b and bound(b[c]) else "")
                               for v, b in zip(row, by))]
            if ratio:
                a, b = row
                cells.append(f"{b / a:.2f}x" if a and b is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if ratio:  # throughput per GPU at a fixed interactivity (loadtest.interactivity)
        lines += [f"### At {at:g} tok/s per user", "", "- " + interactivity.describe(
            interactivity.compare(sweeps[1], sweeps[0], at)), ""]
    problems = [f"{s['label']} c={lv['concurrency']}: load process killed" for s in sweeps for lv in s["levels"]
                if lv.get("driver", lv.get("locust", {})).get("killed")]
    problems += [f"{s['label']} c={lv['concurrency']}: client-bound ({'; '.join(lv['saturation']['reasons'])}): "
                 "the load generator, not the server, set this level's figures" for s in sweeps for lv in s["levels"]
                 if bound(lv)]
    if problems:
        lines += ["### Problems", "", *[f"- {p}" for p in problems], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="loadtest.sweep JSON files, one per configuration")
    p.add_argument("--out", required=True, help="folder for the PNGs and report.md")
    p.add_argument("--at", type=float, default=150.0, help="with two sweeps: tok/s per user to compare "
                   "their throughput per GPU at (the second over the first; default 150)")
    args = p.parse_args(argv)
    try:
        sweeps = load(args.results)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        pngs = plot(sweeps, out)
    except ImportError:
        pngs = []
        print("matplotlib is not installed: writing the tables only (pip install matplotlib)", file=sys.stderr)
    report = out / "report.md"
    report.write_text(markdown(sweeps, pngs, args.at))
    for path in [report, *pngs]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
