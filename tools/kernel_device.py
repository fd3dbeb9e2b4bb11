"""Where a kernel benchmark runs: the GPU when there is one, else Triton's interpreter on the CPU (the checks
and the tables' form, not the timings). Call it before the kernels' modules are imported: they read
TRITON_INTERPRET at import."""

from __future__ import annotations

import os
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
        from tools.bench_quant import _graph_time
        return lambda fn: _graph_time([fn] * calls) * 1e6

    def wall_us(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return wall_us
