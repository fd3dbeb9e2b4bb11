"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

A kernel launched with PDL may be scheduled while its predecessor on the stream is still finishing:
its launch and prologue (index math, weights that no predecessor writes) overlap the predecessor's
tail. It must wait on the grid dependency (griddepcontrol.wait: the predecessor complete, its writes
visible) before it reads or writes anything a predecessor touches, so every kernel that takes the
`PDL` constexpr calls `wait_and_release(PDL)` before its first dependent access; the release right
after lets the next kernel be scheduled once every program here has passed its wait.

One switch for all of them: `DSV4_PDL=1` (or `set_enabled(True)`); off by default until the decode
suites measure it faster on the H200 (suites `pdl_chain`, `decode_switches`). On the CPU (the
interpreter) and before sm_90 the kernels never see PDL=True, so the wait is compiled out. A CUDA
graph captured from PDL launches keeps them as programmatic edges (CUDA >= 12.3 stream capture).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_enabled = os.environ.get("DSV4_PDL", "0") == "1"


def set_enabled(on: bool) -> None:
    """Launch the decode kernels with PDL (read at each launch: graphs captured after this call follow it)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@functools.cache
def _supported(device: int) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.get_device_capability(device)[0] >= 9


def on(t: torch.Tensor) -> bool:
    """Whether a kernel reading `t` launches with PDL now: the switch, a CUDA tensor, sm_90 or later."""
    return _enabled and t.is_cuda and _supported(t.device.index if t.device.index is not None
                                                 else torch.cuda.current_device())


def options(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's launch_pdl option."""
    pdl = on(t)
    return {"PDL": pdl, "launch_pdl": pdl} if pdl else {"PDL": False}


@triton.jit
def wait_and_release(PDL: tl.constexpr):
    """Wait for the predecessor grid (its writes visible), then let the next kernel be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
