"""Kernel variants: the same op computed another way, one switch each, so one GPU run can A/B each against the kernel
it replaces (suites prefill_small_ops, prefill_variants); a variant is off until that run finds it right and faster,
then on by default (DEFAULT), its old kernel kept as the A/B's other side.
Read at every call: CUDA graphs captured after a change follow it.

    DSV4_VARIANTS=rope_tiles,mix_bf16x3   (or "all"; unset: DEFAULT)

- rope_tiles: norm + RoPE (kernels.fused_rope: q per head, the K=V latent into the window cache, plain and inverse
  RoPE, q and kv in one launch) over [ROWS, D] tiles, each row loaded once and stored once, coalesced, the rope
  pairs rotated in registers, instead of one program per row with stride-2 loads and stores of the rope slice;
  ROWS from the row count (kernels.fused_rope.tile_rows: two at decode's few rows).
- mix_bf16x3: mHC's mixing partials (kernels.fused_norm_mhc, hc_pre and V4.1's site collapse) as one bf16
  tensor-core dot a K step of the bf16 streams with the fp32 mixing weights split once into bf16 hi + mid + lo,
  stacked as the dot's columns (exact products, fp32 sums), instead of the streams converted to fp32 and dotted
  at "tf32x3"; bf16 streams only.
- moe_frag: the fused MoE's MXFP4 tiles that decode with integer ops ("bf16") decode straight into the tensor
  cores' operand registers instead ("bf16-frag", kernels/fused_dequant.mxfp4_frag_tile): no round trip of the
  decoded tile through shared memory, the activations and the hidden h in the MMA's K order; one multiply a value
  pair instead of two for the weights whose scale bytes are all <= 128 (checked once per weight: kernels/fused_moe.py
  _tiles; every real checkpoint's, whose weights are far under 12 in magnitude).
- bf16_gemv: bf16 linears at up to kernels.bf16_gemv.BF16_GEMV_MAX_ROWS rows (the compressors' and indexer's
  projections and the MoE router's gate at decode) as one CUDA-core GEMV launch with PDL (kernels/bf16_gemv.py)
  instead of cuBLAS's split-K GEMM and its reduce; weights over BF16_GEMV_MAX_BYTES (the LM head) stay on cuBLAS.
- moe_gemv: the MXFP4 MoE at up to kernels.moe_gemv.MOE_GEMV_MAX_ROWS tokens as one GEMV program per (routed pair,
  N tile, K split) on the CUDA cores (kernels/moe_gemv.py) instead of the MMA kernels' 16-row tiles: no padding,
  no shared memory, no alignment of the pairs by expert.
- indexer_select: the lightning indexer's selection with each token scoring only the entries it sees and picking
  its top-k from them (kernels/indexer_select.py: a sort up to 2,048 seen, a radix select past), instead of scoring
  the whole row (as wide as the longest sequence a CUDA graph may hold: max_model_len / ratio) and sorting it. Rows
  longer than kernels.fused_indexer.SORT_MAX take it without the variant (kernels.fused.indexer_topk_switched:
  measured faster there at every size); the variant forces it on the shorter rows too, where it measured 0.82-1.76x.
- attn_offsets: the paged attention's wgmma tiles (prefill chunks, big decode batches) on CSA layers read each
  slot's key row from a [tokens, window + top-k] table one small launch writes first
  (kernels.fused_attention._slot_offsets), instead of every thread working out the rows of its keys from the block
  tables and the indexer's picks at every key step (sm_90 offline, Triton 3.6: 1,194 instructions a key step
  against 2,173 on the CSA prefill tile, spills 80 bytes against 232).
- fp8_cublas_mid: cuBLAS's blockwise FP8 GEMM (the "cublas" variant of kernels/fused_fp8_linear.py: activations
  quantized 1x128 as DeepSeek's own inference does, then torch's scaled_mm) for V4's FP8 linears from
  quant_configs.FP8_CUBLAS_MID_ROWS rows instead of FP8_CUBLAS_MIN_ROWS: a decode step of 128-255 sequences (batch
  150's profile, H100: the tables' MMA GEMV and "mma" kernel took 11.6 of its 41 ms).
- wo_a_one_launch: the grouped output projection wo_a at GROUPED_ONE_LAUNCH_MAX_T to the cuBLAS rows (decode
  batches of 33-255) as one launch of the programs its per-group launches run (kernels.fused.grouped_linear_fused:
  each group's tiles and K splits as that group's call picks them, so the same sums), writing the [rows, groups x
  R] output in place, instead of a launch per group and a concatenation: 8 launches a layer fewer, one launch's
  tail instead of eight.
"""

from __future__ import annotations

import os

from kernels import fusions

ALL = ("rope_tiles", "mix_bf16x3", "moe_frag", "bf16_gemv", "moe_gemv", "indexer_select", "attn_offsets",
       "fp8_cublas_mid", "wo_a_one_launch")
# rope_tiles on: suite prefill_small_ops finds it within a rounding of the one-row kernels on the GPU and 1.1-1.3x
# faster from 32 tokens up (no slower at one), prefill_variants 1.03x on the time to first token at depth.
# mix_bf16x3 off: right on the GPU at its one-stage prefill launch (kernels/fused_norm_mhc.MIX_PIECES_TILES) and
# 1.15-1.54x faster on the partials, but hc_pre's post / comb part from today's by 1.5e-5 / 6.3e-5 at 2048 / 8192
# tokens (over the suite's 1e-5) and the time to first token moves 1.005x: not worth the looser sums.
# bf16_gemv on: suite decode_variants and its repeats at V4-Flash depth (H100, docs/perf/h100-2026-12-07/) find
# the decode step 1.023x faster at batch 1 (11.44 -> 11.18 ms at 16 experts, 1.03x at 64), 1.014x at 2, 1.006x at
# 4, with logits identical to today's, and 82 fewer launches a step (38.0 -> 36.1 a layer). moe_frag off: 0.93x at
# batch 1, 0.91x at 32 there (kernels_mx_ab: the MoE's decode 1.3x slower alone).
# attn_offsets on: suite attention (H100, docs/perf/h100-2026-12-07d/) finds the CSA attention of a 2,048-token
# chunk 1.53x faster (1,200.3 -> 784.4 us on today's tile), the output identical; prefill_variants' first tokens
# identical, its fastest of 5 rounds 1.02 / 1.05 / 1.08x at 1 x 1024, 4 x 1024, 1 x 8192 tokens (medians 1.03 /
# 0.95 / 0.96x: eager prefill's spread); at decode (the wgmma tiles from 16 tokens) not timed: decode_variants A/Bs it.
# moe_gemv on: decode_variants (H100, docs/perf/h100-2026-12-07e/) 10.20 -> 9.43 ms at batch 1 (1.081x; 1.083x the run
# before), 1.00x at 32 / 150 (it takes 1-4 tokens); the rank share's batch 1 1.040x (tp_share_switches); its logits
# 0.18 from today's, which teacher_forced_variants calls rounding: mean KL to the rounded reference 4.32e-2 against
# the base path's 4.42e-2, top-1 44.5% against 46.9% (4 prompts x 32 positions).
DEFAULT: tuple[str, ...] = ("rope_tiles", "bf16_gemv", "moe_gemv", "attn_offsets")  # ALL's order
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
