"""Where a kernel benchmark runs: the GPU when there is one, else Triton's interpreter on the CPU (the checks
and the tables' form, not the timings). Call it before the kernels' modules are imported: they read
TRITON_INTERPRET at import."""

from __future__ import annotations

import os

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
