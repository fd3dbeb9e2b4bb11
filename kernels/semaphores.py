"""Per-tile counters for kernels whose last program to finish a tile does the tile's epilogue (split-K
reduce, the gate's top-k): int32 zeros on each device, left zero by every kernel that uses them (its
last program resets its counter), so one buffer serves every such kernel on a stream, and CUDA
graphs replay them as captured."""

from __future__ import annotations

import torch

_BUFFERS: dict = {}


def semaphores(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zero counters. Grows only at warm-up (a shape's first call), never inside a graph."""
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernels.semaphores: {count} counters first asked for inside a CUDA graph capture; "
                               "run the step once before capturing it (engine/mixed_graphs.capture warms up twice)")
        buf = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _BUFFERS[device] = buf
    return buf


def all_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in _BUFFERS.values())
