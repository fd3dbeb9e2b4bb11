"""The bf16 GEMV (kernel variant bf16_gemv, kernels/bf16_gemv.py) in Triton's interpreter against float64: each
output within a bf16 rounding of the exact value, as cuBLAS's is, at decode's row counts and shapes that leave
partial tiles in N and K; and which linears the variant takes."""

import pytest
import torch

from kernels import bf16_gemv as bg


@pytest.mark.parametrize("rows,n,k", [(1, 64, 512), (3, 37, 1000), (8, 16, 264)])
def test_gemv_is_the_linear_to_a_bf16_rounding(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    got = bg.bf16_gemv(x.view(1, rows, k), w)
    assert got.shape == (1, rows, n) and got.dtype == torch.bfloat16
    # one rounding to bf16 (to nearest on the GPU: 2^-8 of the value; the interpreter truncates: 2^-7) plus float32
    # sums over K terms (K 2^-24 of their magnitudes)
    bound = 2**-7 * exact.abs() + k * 2**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((got[0].double() - exact).abs() <= bound).all()


def test_which_linears_the_variant_takes():
    w = torch.zeros(1024, 4096, dtype=torch.bfloat16)
    assert bg.fits(1, w, torch.bfloat16) and bg.fits(bg.BF16_GEMV_MAX_ROWS, w, torch.bfloat16)
    assert not bg.fits(bg.BF16_GEMV_MAX_ROWS + 1, w, torch.bfloat16)  # past decode's few rows: cuBLAS
    assert not bg.fits(1, w, torch.float32) and not bg.fits(1, w.float(), torch.bfloat16)
    assert not bg.fits(1, torch.zeros(1024, 4100, dtype=torch.bfloat16), torch.bfloat16)  # K not whole vectors
    assert not bg.fits(1, w.T, torch.bfloat16)  # not contiguous
    head = torch.empty(0, dtype=torch.bfloat16).new_empty((129280, 4096), device="meta")
    assert not bg.fits(1, head, torch.bfloat16)  # the LM head's gigabyte: cuBLAS
    assert not bg.takes(torch.zeros(1, 4096, dtype=torch.bfloat16), w)  # on the CPU never (the variant on or off)
