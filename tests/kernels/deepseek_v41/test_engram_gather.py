"""The Engram row gather (kernels/deepseek_v41/engram_gather.py) against its torch reference, bit for bit
(TRITON_INTERPRET=1 on the CPU): e4m3 rows with ue8m0 or float scales dequantized exactly, float rows
cast, ids of another rank's rows as zeros, awkward widths and row counts, an `out` buffer written in place."""

import pytest
import torch

import kernels
from kernels import fused
from kernels.deepseek_v41 import reference as ref

GATHER = fused.FUSED["v41_engram_gather"]


def _fp8_table(n: int, d: int, group: int, seed: int, subnormal: bool = False):
    """subnormal: one scale byte 0, 2^-127, built from its bits (not a shifted exponent); its products are
    float32 subnormals, which the interpreter's bf16 cast truncates (the GPU rounds): float32 outputs only."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(n, d, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 150, (n, d // group), generator=g, dtype=torch.uint8)
    if subnormal:
        scale[0, 0] = 0
    return rows, scale


def _ids(shape, lo: int, n: int, seed: int) -> torch.Tensor:
    """Ids over the whole table, some below and above this rank's [lo, lo + n)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(max(0, lo - 5), lo + n + 5, shape, generator=g)
    ids.view(-1)[0] = lo  # the first and last row this rank holds
    ids.view(-1)[-1] = lo + n - 1
    return ids


@pytest.mark.parametrize("ids_shape, d, group", [((3, 24), 256, 32), ((5, 6), 32, 32), ((1, 7), 96, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_with_ue8m0_scales_dequantize_as_the_reference(ids_shape, d, group, dtype):
    """V4.1-Flash's shape (24 columns of 256 channels), the tiny preset's, and 3 groups (padded to 4)."""
    rows, scale = _fp8_table(50, d, group, seed=d, subnormal=dtype == torch.float32)
    lo = 20
    ids = _ids(ids_shape, lo, rows.shape[0], seed=d + 1)
    want = ref.engram_gather(ids, rows, scale, lo, dtype)
    got = GATHER(ids, rows, scale, lo, dtype)
    assert got.shape == (*ids_shape, d) and got.dtype == dtype
    assert torch.equal(got, want)
    outside = (ids < lo) | (ids >= lo + rows.shape[0])
    assert outside.any() and not got[outside].any() and got[~outside].abs().sum(-1).min() > 0
    e8m0 = GATHER(ids, rows, scale.view(torch.float8_e8m0fnu), lo, dtype)  # the scale's other stored dtype
    assert torch.equal(e8m0, want)


def test_float_rows_and_float_scales():
    """Float tables: cast without a float32 stop (float64 stays exact); with a float scale (the oracle's
    transformers-named tables carry one of 1s) the product is taken in float32, as the reference does."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 40, generator=g, dtype=torch.float64)
    ids = _ids((4, 5), 0, 30, seed=1)
    assert torch.equal(GATHER(ids, rows, None, 0, torch.float64), ref.engram_gather(ids, rows, None, 0, torch.float64))
    rows32, fscale = rows.float(), torch.rand(30, 1, generator=g) + 0.5
    assert torch.equal(GATHER(ids, rows32, fscale, 0, torch.float64),
                       ref.engram_gather(ids, rows32, fscale, 0, torch.float64))
    bf, mine = rows.to(torch.bfloat16), ids.clamp(max=29)
    assert torch.equal(GATHER(mine, bf, None, 0, torch.float32), bf.float()[mine])  # a plain lookup, widened


def test_out_is_written_in_place_and_empty_ids_are_a_no_op():
    rows, scale = _fp8_table(40, 64, 32, seed=3)
    ids = _ids((2, 9), 10, 40, seed=4)
    out = torch.full((2, 9, 64), float("nan"))
    assert GATHER(ids, rows, scale, 10, torch.float32, out=out) is out
    assert torch.equal(out, ref.engram_gather(ids, rows, scale, 10, torch.float32))
    empty = GATHER(torch.empty(0, 3, dtype=torch.long), rows, scale, 10, torch.float32)
    assert empty.shape == (0, 3, 64)


def test_dispatch_runs_the_reference_on_cpu_tensors():
    rows, scale = _fp8_table(12, 32, 32, seed=5)
    ids = _ids((3, 2), 0, 12, seed=6)
    assert torch.equal(kernels.v41_engram_gather(ids, rows, scale, 0, torch.float32),
                       ref.engram_gather(ids, rows, scale, 0, torch.float32))
