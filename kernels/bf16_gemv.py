"""bf16 linears at decode's few rows on the CUDA cores (kernel variant bf16_gemv): kernels/fused_fp8_linear.py's GEMV
kernel with no scales, in place of cuBLAS.

Why: at one row cuBLAS runs a bf16 linear as a split-K GEMM and a separate reduce (two launches a linear: the
compressors' and indexer's stacked projections, the indexer's wq_b, the MoE router's gate in kernels/fused_gate.py),
and neither takes part in programmatic dependent launch, so the kernels around them cannot overlap their
prologues. The GEMV is one launch (its split-K partials joined by the last split to finish), PDL-aware (its first
weight step loaded before the grid wait), and sums each row's products in float32 as cuBLAS does (another order: a
rounding apart).

Large weights stay on cuBLAS (BF16_GEMV_MAX_BYTES): the LM head (~1 GB) is bandwidth-bound there and one launch."""

from __future__ import annotations

import torch

from kernels import quant_configs, variants
from kernels.fused_fp8_linear import _INTERPRET, _dequant

# the rows and weight bytes up to which the variant takes a bf16 linear: the decode step at depth gains at 1 / 2 / 4
# rows (1.023 / 1.014 / 1.006x) and loses at 8 (0.979x; suite decode_variants' repeats, H100,
# docs/perf/h100-2026-12-07/bf16_gemv_confirm.json). Alone, call by call (suite kernels_bf16_gemv), it beats cuBLAS
# at one row on all but the indexer's wq_b (0.90x) and the router's gate at every row count; the step's gain past
# that is the launches PDL overlaps
BF16_GEMV_MAX_ROWS = 4
BF16_GEMV_MAX_BYTES = 64 << 20
TILES = {"BLOCK_N": 16, "BLOCK_K": 256, "WAVES": 8, "num_warps": 4, "num_stages": 1}
INNER = 64  # the tile's inner width (the FP8 kernel's scale block): 64 bf16 = 128 bytes a row a sub-step


def fits(rows: int, weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """The shapes the GEMV takes: bf16 activations and weight (contiguous, K in whole 16-byte vectors), 1 to
    BF16_GEMV_MAX_ROWS rows, the weight within BF16_GEMV_MAX_BYTES."""
    return (weight.dtype == torch.bfloat16 and x_dtype == torch.bfloat16 and 0 < rows <= BF16_GEMV_MAX_ROWS
            and weight.numel() * 2 <= BF16_GEMV_MAX_BYTES and weight.shape[1] % 8 == 0 and weight.is_contiguous())


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_fused computes x @ weight^T here: the variant on, on the GPU, a shape that fits."""
    return (variants.on("bf16_gemv") and x.is_cuda and x.shape[-1] > 0
            and fits(x.numel() // x.shape[-1], weight, x.dtype))


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, the products summed in float32."""
    *lead, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has {K} columns, the weight {weight.shape[1]}")
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        cfg = dict(tiles or TILES)
        if _INTERPRET:
            cfg.update(quant_configs.INTERPRET_LINEAR["gemv"])
        _dequant(x2, weight, None, y, cfg, gemv=True, block=INNER)
    return y.view(*lead, N)
