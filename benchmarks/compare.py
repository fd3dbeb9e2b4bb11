"""Two result files side by side: every figure both measured, with B / A."""

from __future__ import annotations

from benchmarks.figures import numbers
from benchmarks.report import cell


def step_numbers(result: dict) -> dict[str, float]:
    out = {}
    for step in result["steps"]:
        out |= {f"{step['name']}.{k}": v for k, v in numbers(step.get("figures")).items()}
        if "seconds" in step:
            out[f"{step['name']}.seconds"] = step["seconds"]
    return out


def compare_markdown(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> str:
    na, nb = step_numbers(a), step_numbers(b)
    shared = [k for k in na if k in nb]
    def when(r: dict) -> str:
        return f"{r['suite']}, {r['date']}, {r['machine']['device']}, commit {(r.get('commit') or '?')[:10]}"
    lines = [f"A: {label_a} ({when(a)})", f"B: {label_b} ({when(b)})", "",
             "| figure | A | B | B / A |", "| --- | --- | --- | --- |"]
    for k in shared:
        ratio = f"{nb[k] / na[k]:.3f}" if na[k] else ""
        lines.append(f"| {k} | {cell(na[k])} | {cell(nb[k])} | {ratio} |")
    only = len(na) + len(nb) - 2 * len(shared)
    if only:
        lines.append(f"\n{only} figures measured by one side only.")
    return "\n".join(lines) + "\n"
