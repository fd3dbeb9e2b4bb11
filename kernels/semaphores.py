"""Per-tile counters for kernels whose last program to finish a tile does the tile's epilogue (split-K
reduce, the gate's top-k): int32 zeros on each device, left zero by every kernel that uses them (its
last program resets its counter), so one buffer serves every such kernel on a stream, and CUDA
graphs replay them as captured."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BUFFERS: dict = {}
_RETIRED: list = []  # outgrown buffers: graphs captured before the growth still point at them


def semaphores(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zero counters. Grows only at warm-up (a shape's first call), never inside a graph."""
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernels.semaphores: {count} counters first asked for inside a CUDA graph capture; "
                               "run the step once before capturing it (engine/mixed_graphs.capture warms up twice)")
        if buf is not None:
            _RETIRED.append(buf)  # never freed: its memory must not be handed to another tensor
        buf = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _BUFFERS[device] = buf
    return buf


def all_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in _BUFFERS.values())


@triton.jit
def split_k_arrive(ws_ptr, off, mask, acc, tile_ptr, pid_k, SPLIT_STRIDE, SPLITS: tl.constexpr):
    """A split-K program's float32 partial `acc`, stored at ws_ptr + pid_k * SPLIT_STRIDE + off; True for
    the last split of its tile to arrive (its counter at tile_ptr then reset for the next call), which
    adds the others' partials with split_k_total."""
    tl.store(ws_ptr + pid_k * SPLIT_STRIDE + off, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before the counter's release
    last = tl.atomic_add(tile_ptr, 1, sem="acq_rel") == SPLITS - 1
    if last:
        tl.atomic_xchg(tile_ptr, 0)  # zero again (CUDA graphs replay it as is)
    return last


@triton.jit
def split_k_total(ws_ptr, off, mask, acc, pid_k, SPLIT_STRIDE, SPLITS: tl.constexpr):
    """acc plus every other split's partial, added in split order whichever program is last, so the sum
    does not depend on arrival order (volatile loads: from L2, never a stale L1 line)."""
    total = tl.zeros_like(acc)
    for s in tl.static_range(SPLITS):
        part = tl.load(ws_ptr + s * SPLIT_STRIDE + off, mask=mask, other=0.0, volatile=True)
        total += tl.where(pid_k == s, acc, part)
    return total
