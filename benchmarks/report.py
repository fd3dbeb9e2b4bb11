"""Result files as markdown: per step, its tables and scalars, or its output's tail for a tool that
prints a table instead of writing JSON."""

from __future__ import annotations

from benchmarks.figures import SKIP, flat_scalars, tables

MAX_COLUMNS = 12
MAX_ROWS = 60


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    return "" if v is None else str(v).replace("|", "/").replace("\n", " ")[:60]


def markdown_table(rows: list[dict]) -> str:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    columns = columns[:MAX_COLUMNS]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"({len(rows) - MAX_ROWS} more rows in the JSON)")
    return "\n".join(lines)


def step_markdown(step: dict) -> str:
    head = f"### {step['name']} (`{step['tool']}`"
    if "skipped" in step:
        return head + f"): skipped, {step['skipped']}"
    head += f", {step['seconds']} s" + (", exit " + str(step["rc"]) if step["rc"] else "") + ")"
    parts = [head]
    figures = step.get("figures")
    if isinstance(figures, dict):
        figures = {k: v for k, v in figures.items() if k not in SKIP}
        scalars = flat_scalars(figures)
        if scalars:
            parts.append(markdown_table([{"figure": k, "value": v} for k, v in scalars.items()]))
    for path, rows in tables(figures):
        parts.append(f"`{path or 'rows'}`:\n\n" + markdown_table(rows))
    if figures is None and step.get("output_tail"):
        parts.append("```\n" + "\n".join(step["output_tail"]) + "\n```")
    return "\n\n".join(parts)


def result_markdown(result: dict) -> str:
    commit = (result.get("commit") or "?")[:10] + (" (dirty)" if result.get("dirty") else "")
    head = [f"## {result['suite']}", "", result["question"], "",
            f"{result['date']}, {result['machine']['device']}, commit {commit}"
            + (f", preset {result['preset']}" if result.get("preset") else "")
            + ("" if result.get("ok", True) else ", **a step failed**")]
    return "\n".join(head) + "\n\n" + "\n\n".join(step_markdown(s) for s in result["steps"]) + "\n"

