"""Benchmark helper: the CPU seconds each kind of process spends while a command runs.

    .venv/bin/python -m tools.profile_processes --json out.json -- .venv/bin/python -m loadtest.sweep --serve ...

Samples /proc every second for the command's descendants whose command line holds one of the labels' patterns
(default: Triton's python stub, the engine core process, tritonserver) and prints a table of CPU
seconds per label (utime + stime, the most seen per pid, summed over pids); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

PATTERNS = {"stub (front)": b"triton_python_backend_stub", "engine core": b"multiprocessing.spawn",
            "tritonserver": b"bin/tritonserver"}


def _cpu_s(pid: str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> set[str]:
    """The command's process tree only (other work on the machine is not ours to count)."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
    tree, grew = {str(root)}, True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in tree and pid not in tree}
        tree |= new
        grew = bool(new)
    return tree


def sample(seen: dict, root: int) -> None:
    for pid in _descendants(root):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            for label, pattern in PATTERNS.items():
                if pattern in cmdline:
                    seen[(label, pid)] = max(seen.get((label, pid), 0.0), _cpu_s(pid))
        except OSError:
            continue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    seen: dict = {}
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, proc.pid)
        time.sleep(1.0)
    totals: dict = {}
    for (label, _), cpu in seen.items():
        totals[label] = totals.get(label, 0.0) + cpu
    for label, cpu in totals.items():
        print(f"{label:<14} {cpu:8.1f} CPU s")
    with open(a.json, "w") as f:
        json.dump({"command": command, "cpu_s": totals, "exit_code": proc.returncode}, f, indent=1)
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
