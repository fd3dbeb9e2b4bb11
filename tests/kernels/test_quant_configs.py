"""kernels/quant_configs.py: the measured tables (kernels/configs/*.json) and the reasoned defaults give known
shapes the configs the engine runs them with."""

import pytest

from kernels import quant_configs

_GEMV = {"variant": "gemv", "BLOCK_N": 16, "BLOCK_K": 512, "WAVES": 8, "num_warps": 4, "num_stages": 1}


def _dq(bm, bn, w, st):
    return {"variant": "dequant", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": w,
            "num_stages": st, "W_CVT": "int"}


def _mm(bm, bn, w, st):
    return {"variant": "mma", "BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st}


def _moe(bm, bn, bk, w, st, mx=None):
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st, **({"MX": mx} if mx else {})}
    return {"gate_up": cfg, "down": cfg}


@pytest.mark.parametrize("m, n, k, want", [
    (1, 1024, 4096, _GEMV),  # wq_a: the one-row gemv
    (32, 1024, 4096, _dq(32, 32, 4, 4)),
    (4097, 1024, 4096, _mm(128, 64, 4, 4)),
    (150, 2048, 4096, _mm(64, 64, 4, 4)),  # shared_w1: the mma kernel from 65 rows (kernels_fp8_mid)
    (2048, 4096, 8192, _mm(128, 128, 8, 3)),  # wo_b
    (1, 32768, 1024, _mm(64, 128, 4, 4)),  # wq_b: no gemv row
    (8192, 32768, 1024, _mm(64, 128, 4, 4)),
    (1, 1536, 4096, _GEMV),  # the stacked wq_a + wkv: wq_a's tiles
    (65, 4096, 4096, _mm(64, 64, 4, 4)),  # the stacked w1 + w3: shared_w1's
    (1, 512, 4096, _GEMV),  # no entry: the defaults
    (513, 512, 4096, _mm(128, 128, 8, 4)),
])
def test_fp8_linear_config_per_shape(m, n, k, want):
    assert quant_configs.fp8_linear_config(m, n, k) == want


@pytest.mark.parametrize("tokens, experts, fmt, want", [
    (1, 16, "mxfp4", _moe(16, 64, 128, 4, 3, "bf16")),
    (150, 16, "mxfp4", _moe(64, 64, 128, 4, 4, "bf16")),
    (150, 16, "fp8", _moe(128, 64, 128, 8, 3)),
    (150, 16, "dense", _moe(32, 64, 128, 4, 3)),
    (2048, 256, "mxfp4", _moe(64, 128, 64, 8, 3, "bf16")),
    (8192, 256, "mxfp4", _moe(128, 128, 128, 8, 3, "bf16-frag")),  # 192 rows per expert: the frag tile
    (4096, 64, "mxfp4", _moe(128, 128, 128, 8, 3, "bf16-frag")),  # 384 (the grouped path's, where it dispatches)
    (1000, 64, "mxfp4", _moe(64, 128, 64, 8, 3, "bf16")),  # 94: the table's
    (8192, 256, "fp8", _moe(64, 128, 64, 8, 3)),  # no measured prefill entry: the default tiles
])
def test_moe_config_per_shape(tokens, experts, fmt, want):
    assert quant_configs.moe_config(tokens, tokens * 6, experts, fmt) == want


def test_every_format_has_every_decode_tile():
    """moe_block_m may pick any tile up to a format's cap: each format's table must hold it."""
    for fmt, cap in quant_configs.MOE_BLOCK_M_MAX.items():
        assert {bm for bm in (16, 32, 64, 128) if bm <= cap} <= set(quant_configs.MOE_DECODE[fmt]), fmt
