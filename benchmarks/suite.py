"""What a suite is: a question, and the tool calls that answer it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One tool call. In `args`, {out} (the run's work folder), {ckpt} (the checkpoint cache) and
    {preset} (the suite's model preset) are filled in by the runner."""

    tool: str  # a module run as `python -m tool`
    args: tuple[str, ...] = ()
    name: str = ""  # the step's key in the result; the tool's last name part when empty
    json_flag: str | None = "--json"  # the tool's flag for its JSON file; None: it writes none of its own
    result: str | None = None  # a JSON file the tool writes by itself (loadtest.sweep's {out}/LABEL.json)
    python: str = "engine"  # "triton": the interpreter that can start Triton ($BENCH_TRITON_PYTHON)
    unless_exists: str | None = None  # skip the step when this path exists (a checkpoint already written)
    then_remove: str | None = None  # a glob under {ckpt} removed after the step (disk is 64 GB on the H200)
    timeout_s: int = 600

    @property
    def key(self) -> str:
        return self.name or self.tool.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Suite:
    name: str
    question: str
    steps: tuple[Step, ...]
    machine: str = "h200"  # where its figures mean something: "h200" or "cpu"
    preset: str | None = None  # the model preset {preset} stands for; `run --preset` replaces it
    notes: str = ""
