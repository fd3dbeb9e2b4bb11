"""Where a kernel benchmark runs: the GPU when there is one, else Triton's interpreter on the CPU (the checks
and the tables' form, not the timings). Call it before the kernels' modules are imported: they read
TRITON_INTERPRET at import."""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def gpu_or_interpreter() -> torch.device:
    """cuda when available; else cpu, with TRITON_INTERPRET=1 set (unless the environment says otherwise)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def sync() -> None:
    """Wait for the GPU's queued work before reading a clock (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def call_timer(on_gpu: bool, calls: int = 1):
    """fn -> microseconds a call: on the GPU `calls` calls captured in one CUDA graph and replayed (launch cost gone,
    as in the engine's graphs); in the interpreter the wall time of one call (the table's form, not a timing)."""
    if on_gpu:
        return lambda fn: graph_time([fn] * calls) * 1e6

    def wall_us(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return wall_us


def graph_time(calls: list, replays: int = 3) -> float:
    """Seconds per call: the calls captured in one CUDA graph, replayed; the median replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the allocator outside the capture
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def finish(tool: str, rows: list[dict], json_path: str | None, failures: list[str]) -> int:
    """A sweep's end: its rows as JSON (if asked), each failure named, then exit_status."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(rows, fh, indent=1)
    return report_failures(tool, failures)


def report_failures(tool: str, failures: list[str]) -> int:
    """A run's end: each failure named on stdout, then exit_status."""
    for f in failures:
        print("  MISMATCH", f, flush=True)
    return exit_status(tool, failures)


def exit_status(tool: str, failures: list[str]) -> int:
    """1 when a kernel disagreed with its reference (named on stderr), else 0."""
    if failures:
        print(f"{tool}: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    return 0
