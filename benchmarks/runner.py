"""Run a suite: each step's tool as a subprocess, its output streamed and kept, its JSON gathered
into one result file with the date, machine and git commit."""

from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from benchmarks.suite import Step, Suite

ROOT = Path(__file__).resolve().parent.parent
TAIL_LINES = 60  # of each step's output kept in the result (a profile's table fits)


def device_name() -> str:
    """The GPU's name from nvidia-smi (no torch import), else the CPU and its core count."""
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True)
        names = [n.strip() for n in r.stdout.splitlines() if n.strip()]
        if r.returncode == 0 and names:
            return f"{len(names)} x {names[0]}" if len(names) > 1 else names[0]
    return f"cpu ({os.cpu_count()} cores)"


def git_commit() -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def fill(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text


def python_for(step: Step) -> str:
    if step.python == "triton":  # the H200 image's own Python cannot start Triton: tools/h200_env.sh builds one
        return os.environ.get("BENCH_TRITON_PYTHON", sys.executable)
    return sys.executable


# A checkpoint is drawn only with this much free on its disk: V4-Flash depth at 64 routed experts is ~25 GB, and
# a queue of suites leaves theirs behind (a 64 GB machine ran out after three)
CKPT_FREE_BYTES = 40 << 30
CHECKPOINT_TOOL = "tools.make_tiny_checkpoint"


def make_room(ckpt: Path, keep: set[str], need: int = CKPT_FREE_BYTES) -> list[str]:
    """Remove checkpoints under `ckpt` that the running suite does not name (`keep`: their directory names), least
    recently written first, until its disk has `need` bytes free. Returns the names removed."""
    if not ckpt.is_dir():
        return []
    removed = []
    others = sorted((p for p in ckpt.iterdir() if p.is_dir() and p.name not in keep), key=lambda p: p.stat().st_mtime)
    for path in others:
        if shutil.disk_usage(ckpt).free >= need:
            break
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def suite_checkpoints(suite: Suite, values: dict[str, str]) -> set[str]:
    """The directory names under {ckpt} that a suite's steps name."""
    root = values["ckpt"].rstrip("/") + "/"
    return {fill(a, values)[len(root):].split("/")[0] for s in suite.steps for a in s.args
            if fill(a, values).startswith(root)}


def run_step(step: Step, values: dict[str, str], work: Path, keep: set[str] = frozenset()) -> dict:
    """keep: the checkpoints the suite names (a checkpoint drawn makes room by removing others)."""
    args = [fill(a, values) for a in step.args]
    row: dict = {"name": step.key, "tool": step.tool}
    if step.unless_exists and Path(fill(step.unless_exists, values)).exists():
        return row | {"argv": args, "skipped": "exists: " + fill(step.unless_exists, values)}
    if step.tool == CHECKPOINT_TOOL and (removed := make_room(Path(values["ckpt"]), keep)):
        print(f"== {step.key}: removed checkpoints {removed} for disk room", flush=True)
        row["removed_checkpoints"] = removed
    json_path = None
    if step.json_flag:
        json_path = Path(tempfile.mkstemp(prefix=f"{step.key}-", suffix=".json", dir=work)[1])
        args = [step.json_flag, str(json_path), *args]  # before the tool's own args: some end in a command
    elif step.result:
        json_path = Path(fill(step.result, values))
    argv = [python_for(step), "-m", step.tool, *args]
    print(f"== {step.key}: {' '.join(argv[1:])}", flush=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    t0 = time.monotonic()
    with open(work / f"{values['suite']}.{step.key}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(step.timeout_s, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:  # streamed: a long step shows its progress
                sys.stdout.write(line)
                log.write(line)
                tail.append(line.rstrip("\n"))
            rc = proc.wait()
        finally:
            watchdog.cancel()
    row |= {"argv": args, "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    if time.monotonic() - t0 >= step.timeout_s:
        row["timed_out"] = True
    if json_path is not None and json_path.exists() and json_path.stat().st_size:
        try:
            row["figures"] = json.loads(json_path.read_text())
        except json.JSONDecodeError as e:
            row["json_error"] = str(e)
        if step.json_flag:
            json_path.unlink()
    elif json_path is not None and step.json_flag:
        json_path.unlink(missing_ok=True)
    row["output_tail"] = list(tail)
    if step.then_remove:
        for path in glob.glob(os.path.join(values["ckpt"], fill(step.then_remove, values))):
            shutil.rmtree(path, ignore_errors=True)
    return row


def run_suite(suite: Suite, preset: str | None = None, work: Path = Path("out"),
              ckpt: str = "/tmp/ckpt") -> dict:
    """Run every step (one failing does not stop the rest) and return the result document."""
    uses_preset = any("{preset}" in a for s in suite.steps for a in s.args)
    if preset is not None and not uses_preset:
        raise ValueError(f"suite {suite.name} takes no --preset")
    work.mkdir(parents=True, exist_ok=True)
    values = {"suite": suite.name, "out": str(work.resolve()), "ckpt": ckpt, "preset": preset or suite.preset or "",
              "python": sys.executable}
    started = datetime.datetime.now(datetime.UTC)
    keep = suite_checkpoints(suite, values)
    steps = [run_step(step, values, work, keep) for step in suite.steps]
    return {"suite": suite.name, "question": suite.question,
            "date": started.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "machine": {"device": device_name(), "host": platform.node(), "platform": platform.platform(),
                        "python": platform.python_version()},
            **git_commit(), "preset": values["preset"] or None,
            "ok": all(s.get("rc", 0) == 0 and "json_error" not in s for s in steps), "steps": steps}
