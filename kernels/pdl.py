"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

A kernel launched with PDL may be scheduled while its predecessor on the stream is still finishing:
its launch and prologue (index math, weights that no predecessor writes) overlap the predecessor's
tail. It must wait on the grid dependency (griddepcontrol.wait: the predecessor complete, its writes
visible) before it reads or writes anything a predecessor touches, so every kernel that takes the
`PDL` constexpr calls `wait_and_release(PDL)` before its first dependent access; the release right
after lets the next kernel be scheduled once every program here has passed its wait.

One switch for all of them: the engine argument `pdl` (auto | on | off, `configure`), or `DSV4_PDL=1` /
`DSV4_PDL=0`, which overrides the argument (experiments), or `set_enabled` (tools). `auto` is on where PDL
can run (`available`: a CUDA device of sm_90 or later, compiled kernels, a Triton that launches with it).
On the CPU (the interpreter) and before sm_90 the kernels never see PDL=True, so the wait is compiled out.
A CUDA graph captured from PDL launches keeps them as programmatic edges (CUDA >= 12.3 stream capture);
suite `pdl_paths` (tools/check_pdl_paths.py) checks every served graph path gives the same logits with it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODES = ("auto", "on", "off")
ENV = "DSV4_PDL"  # "1" / "0": overrides the engine argument (experiments)
_enabled = os.environ.get(ENV, "0") == "1"


def set_enabled(on: bool) -> None:
    """Launch the decode kernels with PDL (read at each launch: graphs captured after this call follow it)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@functools.cache
def _supported(device: int) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.get_device_capability(device)[0] >= 9


def launchable() -> bool:
    """Whether this Triton can launch with PDL and wait on the grid dependency (Triton >= 3.4)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def available(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: CUDA, sm_90 or later, not the interpreter, a Triton
    that launches with it."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device()) and launchable()


def configure(mode: str, device: torch.device) -> bool:
    """The engine argument `pdl` applied (auto: `available`), unless DSV4_PDL says otherwise; -> whether
    the decode kernels now launch with PDL (on a device without it, "on" still launches plain: `on`)."""
    if mode not in MODES:
        raise ValueError(f"pdl must be one of {MODES}, not {mode!r}")
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        want = forced == "1"
    else:
        want = mode == "on" or (mode == "auto" and available(device))
    set_enabled(want)
    return want and available(device)


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
