"""Kernel variants: the same op computed another way, one switch each, off by default (today's kernels), so one
GPU run can A/B each against the kernel it would replace (suite prefill_small_ops) before it becomes the default.
Read at every call: CUDA graphs captured after a change follow it.

    DSV4_VARIANTS=rope_tiles,mix_bf16x3   (or "all"; unset: DEFAULT)

- rope_tiles: norm + RoPE (kernels.fused_rope: q per head, the K=V latent into the window cache, plain and inverse
  RoPE, q and kv in one launch) over [ROWS, D] tiles, each row loaded once and stored once, coalesced, the rope
  pairs rotated in registers, instead of one program per row with stride-2 loads and stores of the rope slice;
  ROWS from the row count (kernels.fused_rope.tile_rows: one at decode's few rows).
- mix_bf16x3: mHC's mixing partials (kernels.fused_norm_mhc, hc_pre and V4.1's site collapse) as one bf16
  tensor-core dot a K step of the bf16 streams with the fp32 mixing weights split once into bf16 hi + mid + lo,
  stacked as the dot's columns (exact products, fp32 sums), instead of the streams converted to fp32 and dotted
  at "tf32x3"; bf16 streams only.
"""

from __future__ import annotations

import os

from kernels import fusions

ALL = ("rope_tiles", "mix_bf16x3")
# neither on: suite prefill_small_ops found the first mix_bf16x3 (three chained dots) wrong on the GPU at the
# prefill tiles, and judged rope_tiles by each element's own last places, which an exactly cancelling pair
# defeats (docs/PERF.md, "Prefill at V4-Flash depth"); both wait for its next run
DEFAULT: tuple[str, ...] = ()
ENV = "DSV4_VARIANTS"

_on = fusions.parse(os.environ.get(ENV, ",".join(DEFAULT)), ALL, "kernel variants")


def set_variants(spec: str | tuple[str, ...]) -> None:
    """Turn on exactly these variants (a comma list, "all", or names); the rest off."""
    global _on
    _on = fusions.parse(spec if isinstance(spec, str) else ",".join(spec), ALL, "kernel variants")


def on(name: str) -> bool:
    if name not in ALL:
        raise ValueError(f"unknown kernel variant {name!r}")
    return name in _on


def enabled() -> tuple[str, ...]:
    return tuple(n for n in ALL if n in _on)
