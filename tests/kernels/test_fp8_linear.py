"""Block-scaled FP8 linear (both variants) and the stored formats vs their torch references, under
the Triton interpreter: one row, K and N at and off the 128 block, float32 (Base) and ue8m0 scales.
The interpreter runs the FP8 variant's quantize / rescale arithmetic with its dot done in float32
on the e4m3 values (the same products); the tensor-core instruction itself runs in tools/bench_quant.py."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import reference as ref
from kernels.formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_act_1x128,
    quantize_fp8_block,
    quantize_mxfp4,
    scale_to_float,
    unpack_e2m1,
)
from kernels.fused_fp8_linear import fp8_linear_fused, variant_for

SHAPES = [(1, 128, 128), (1, 200, 72), (7, 256, 384), (19, 130, 257), (64, 64, 128)]  # (M, N, K)
# The gemv runs one program per activation row, each row on its own: 3 rows check the row indexing
# as well as 19 or 64 do, at a fraction of the interpreter's time; N and K stay awkward.
GEMV_ROWS = 3


class OpNames(TorchDispatchMode):
    """The aten ops a call dispatches, by name (a copy shows as clone, a concatenation as cat)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _case(m, n, k, ue8m0, seed=0):
    g = torch.Generator().manual_seed(seed + m * 7 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    q, s = quantize_fp8_block(w, ue8m0=ue8m0)
    return x, q, scale_to_float(s)


def _grouped_case(m: int, groups: int, rows: int, k: int, seed: int):
    """bf16 activations [m, groups, k] and a grouped FP8 weight [groups * rows, k] with float32 block scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, groups, k, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8_block(torch.randn(groups * rows, k, generator=g) / k**0.5, ue8m0=True)
    return x, q, scale_to_float(s)


@pytest.mark.parametrize("m, n, k, variant", [(m, n, k, "dequant") for m, n, k in SHAPES] +
                         [(min(m, GEMV_ROWS), n, k, "gemv") for m, n, k in SHAPES])
@pytest.mark.parametrize("ue8m0", [True, False])
def test_weight_dequantizing_variants_match_reference(m, n, k, ue8m0, variant):
    x, q, s = _case(m, n, k, ue8m0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        want = ref.linear(x.to(dtype), q, s).float()
        got = fp8_linear_fused(x.to(dtype), q, s, variant=variant).float()
        assert (got - want).abs().max() <= tol * want.abs().max(), (dtype, (got - want).abs().max())


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_fp8_mma_variant_matches_its_reference(m, n, k, dtype, tol):
    """Against the act-quant reference: equal up to accumulation order (float32) or the output's
    bf16 rounding; bf16 activations put many e4m3 roundings on exact ties, so this also checks
    ties go to even. Against the plain reference: within e4m3's activation error."""
    x, q, s = _case(m, n, k, ue8m0=True)
    x = x.to(dtype)
    got = fp8_linear_fused(x, q, s, variant="mma").float()
    exact = ref.linear_act_quant(x, q, s).float()
    plain = ref.linear(x, q, s).float()
    scale = plain.abs().max()
    assert (got - exact).abs().max() <= tol * scale
    assert (got - plain).abs().max() <= 0.1 * scale  # e4m3 keeps 3 mantissa bits of each activation


def test_leading_dims_and_empty_rows():
    x, q, s = _case(6, 130, 128, ue8m0=True)
    got = fp8_linear_fused(x.view(2, 3, 128), q, s, variant="dequant")
    assert got.shape == (2, 3, 130) and torch.allclose(got.view(6, 130), ref.linear(x, q, s), atol=1e-5)
    assert fp8_linear_fused(x[:0], q, s).shape == (0, 130)


@pytest.mark.parametrize("variant, m", [(v, m) for v in ("dequant", "gemv", "mma")
                                         for m in (1, GEMV_ROWS if v == "gemv" else 19)])
def test_grouped_linear_in_one_call_matches_reference(variant, m):
    """wo_a: groups of 128-row blocks, each reading its own slice of x; the dequant variant in one
    launch, split-K reduced in the kernel by the last split of each tile (its counters left at zero
    for the next call, which must give the same result)."""
    from kernels.semaphores import all_zero

    groups, rows, k = 3, 128, 192
    x, q, s = _grouped_case(m, groups, rows, k, seed=m)
    want = ref.grouped_linear(x, q, groups, s).float()
    got = fp8_linear_fused(x, q, s, variant=variant, groups=groups).float()
    tol = 0.1 if variant == "mma" else 1e-2  # mma: e4m3 activations
    assert got.shape == (m, groups * rows) and (got - want).abs().max() <= tol * want.abs().max()
    again = fp8_linear_fused(x, q, s, variant=variant, groups=groups).float()
    assert torch.equal(again, got)
    assert all_zero()


def test_variant_table_picks_gemv_dequant_and_mma_by_rows():
    """One row on the CUDA cores, a few rows the dequant GEMV on the tensor cores, prefill FP8 MMA;
    wo_b's K 8192 keeps the dequant GEMV at one row (measured faster there)."""
    assert variant_for(1, 4096, 4096) == "gemv" and variant_for(8, 4096, 4096) == "dequant"
    assert variant_for(8192, 4096, 4096) == "mma" and variant_for(1, 4096, 8192) == "dequant"


def test_formats_round_trip_and_layout():
    w = torch.randn(3, 40, 96)
    p, s = quantize_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (3, 40, 48) and s.shape == (3, 40, 3)
    d = dequantize_mxfp4(p, s)
    # each value within half a step of e2m1 at its group's scale (steps <= 2 x scale)
    assert ((d - w).abs() <= scale_to_float(s).repeat_interleave(32, -1) + 1e-6).all()
    # low nibble first: byte 0x21 holds 0.5 (code 1) then 1.0 (code 2)
    assert unpack_e2m1(torch.tensor([[0x21, -0x78]], dtype=torch.int8)).tolist() == [[0.5, 1.0, -0.0, 0.0]]
    q, sf = quantize_fp8_block(w[0].T.contiguous(), ue8m0=True)
    assert sf.dtype == torch.float8_e8m0fnu and sf.shape == (1, 1)
    assert (dequantize_fp8_block(q, sf) - w[0].T).abs().max() <= 0.07 * w[0].abs().max()
    xq, xs = quantize_act_1x128(torch.randn(3, 200))
    assert xq.shape == (3, 200) and xs.shape == (3, 2)


@pytest.mark.parametrize("m", [2, 33])
def test_grouped_linear_dispatch_one_launch_or_per_group(m):
    """kernels.fused.grouped_linear_fused: one launch up to GROUPED_ONE_LAUNCH_MAX_T rows, one launch
    per group past it; both equal the reference."""
    from kernels.fused import GROUPED_ONE_LAUNCH_MAX_T, grouped_linear_fused

    assert (m <= GROUPED_ONE_LAUNCH_MAX_T) == (m == 2)
    groups, rows, k = 2, 128, 128
    x, q, s = _grouped_case(m, groups, rows, k, seed=m)
    want = ref.grouped_linear(x, q, groups, s).float()
    got = grouped_linear_fused(x, q, groups, s).float()
    assert got.shape == (m, groups * rows) and (got - want).abs().max() <= 0.1 * want.abs().max()


def test_wo_a_in_one_launch_is_the_per_group_launches_result_bit_for_bit():
    """Kernel variant wo_a_one_launch: past GROUPED_ONE_LAUNCH_MAX_T rows one grouped launch of the per-group calls'
    tiles and K splits gives their concatenated outputs exactly (the same programs, the same sums), without the
    concatenation; the per-group path equals the reference."""
    from kernels import variants
    from kernels.fused import GROUPED_ONE_LAUNCH_MAX_T, grouped_linear_fused

    m, groups, rows, k = GROUPED_ONE_LAUNCH_MAX_T + 1, 3, 128, 256
    x, q, s = _grouped_case(m, groups, rows, k, seed=5)
    saved = variants.enabled()
    try:
        variants.set_variants(tuple(v for v in saved if v != "wo_a_one_launch"))
        with OpNames() as per_group:
            want = grouped_linear_fused(x, q, groups, s)
        variants.set_variants((*saved, "wo_a_one_launch"))
        with OpNames() as one:
            got = grouped_linear_fused(x, q, groups, s)
    finally:
        variants.set_variants(saved)
    assert torch.equal(got, want)
    ref_out = ref.grouped_linear(x, q, groups, s).float()
    assert (want.float() - ref_out).abs().max() <= 0.05 * ref_out.abs().max()
    assert "cat.default" in per_group.names and "cat.default" not in one.names


@pytest.mark.parametrize("variant, m", [("gemv", GEMV_ROWS), ("dequant", 33), ("mma", 5)])
def test_rows_at_a_stride_give_the_contiguous_rows_result_and_the_gemvs_copy_nothing(variant, m):
    """x with a row stride wider than its K (one wo_a group's columns, as grouped_linear_fused's per-group calls
    pass them): the same output as the rows copied out, bit for bit; the GEMVs read the rows in place (no copy
    kernel before them), "mma" (which reads x as [M, K]) copies first."""
    x, q, s = _case(m, 256, 384, ue8m0=True)
    wide = torch.randn(m, 3, 384, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    wide[:, 1] = x.to(torch.bfloat16)
    strided = wide[:, 1]
    assert not strided.is_contiguous()
    with OpNames() as ops:
        got = fp8_linear_fused(strided, q, s, variant=variant)
    want = fp8_linear_fused(strided.contiguous(), q, s, variant=variant)
    assert torch.equal(got, want)
    copied = any(n.startswith("clone") for n in ops.names)  # .contiguous() (the interpreter's launches copy_)
    assert copied == (variant == "mma")


@pytest.mark.parametrize("variant", ["dequant", "gemv", "mma"])
@pytest.mark.parametrize("m, n1, n2, k", [(1, 128, 72, 192), (19, 100, 156, 128)])
def test_split_linear_one_launch_matches_two_linears(variant, m, n1, n2, k):
    """Two linears of one input stacked along N (wq_a over wkv): each output contiguous and equal to
    its own linear, at and off the 128 block and the tile (n1 = 100 splits a BLOCK_N tile)."""
    x, q, s = _case(m, n1 + n2, k, ue8m0=True)
    x = x.to(torch.bfloat16)
    a, b = fp8_linear_fused(x.view(1, m, k), q, s, variant=variant, split_n=n1)
    assert a.shape == (1, m, n1) and b.shape == (1, m, n2) and a.is_contiguous() and b.is_contiguous()
    tol = 0.1 if variant == "mma" else 1e-2  # mma: e4m3 activations
    for got, want in zip((a[0], b[0]), ref.linear_split(x, q, n1, s)):
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    with pytest.raises(ValueError, match="split_n"):
        fp8_linear_fused(x, q, s, split_n=n1 + n2)


def test_grouped_linear_variant_chosen_by_the_per_group_shape(monkeypatch):
    """The grouped linear's variant comes from the same per-group (N / groups, K) entry as its tiles
    (it used the total N: the default entry's "dequant" ran with a per-group "mma" config)."""
    from kernels import fused_fp8_linear as ffl
    from kernels import quant_configs

    groups, rows, k = 2, 128, 128
    monkeypatch.setitem(quant_configs.FP8_LINEAR, (rows, k), [(None, quant_configs._MID)])
    ran = []
    for name in ("_mma", "_dequant"):
        real = getattr(ffl, name)
        monkeypatch.setattr(ffl, name, lambda *a, _real=real, _name=name, **kw: ran.append(_name) or _real(*a, **kw))
    x, q, s = _grouped_case(1, groups, rows, k, seed=3)
    got = fp8_linear_fused(x, q, s, groups=groups).float()
    want = ref.grouped_linear(x, q, groups, s).float()
    assert ran == ["_mma"] * groups and (got - want).abs().max() <= 0.1 * want.abs().max()


def test_grouped_gemv_tiles_narrow_to_groups_of_32_rows():
    """V4.1's wo_a at 8-way tensor parallelism has 32 rows a group: the table's 64-wide GEMV tile would straddle
    two groups (the launch refused it); the tile narrows to the group, and a group that holds whole tiles keeps
    the table's."""
    from kernels.fused_fp8_linear import group_tiles

    wide = {"variant": "dequant", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 0}
    assert group_tiles(wide, 32) == {**wide, "BLOCK_N": 32} and wide["BLOCK_N"] == 64
    assert group_tiles(wide, 96)["BLOCK_N"] == 32 and group_tiles(wide, 128) is wide
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8_block(torch.randn(4 * 32, 64, generator=g) / 8, ue8m0=True, block=32)
    s = scale_to_float(s)
    want = ref.grouped_linear(x, q, 4, s).float()
    got = fp8_linear_fused(x, q, s, variant="dequant", groups=4).float()
    assert got.shape == (2, 128) and (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_integer_e4m3_to_bf16_recipe_equals_the_cast_for_every_code():
    """The GPU's "int" weight conversion (PTX the interpreter cannot run): its constants read from the
    asm and its instructions done here on the bits (prmt with sign replication, shift, mask, one
    bf16 multiply by 2^120) give every e4m3 code's value in both lanes, -0 and subnormals included;
    NaN (0x7f, 0xff) becomes 480, which a finite checkpoint never holds."""
    import re
    import struct

    from kernels.fused_fp8_linear import _E4M3_BF16_ASM

    asm = str(getattr(_E4M3_BF16_ASM, "value", _E4M3_BF16_ASM))
    big = int(re.search(r"mov.b32 big, (0x[0-9A-Fa-f]+)", asm).group(1), 16)
    sel = int(re.search(r"prmt.b32 a, w, 0, (0x[0-9A-Fa-f]+)", asm).group(1), 16)
    shift = int(re.search(r"shl.b32 a, a, (\d+)", asm).group(1))
    mask = int(re.search(r"and.b32 a, a, (0x[0-9A-Fa-f]+)", asm).group(1), 16)

    def prmt(word, c):  # PTX prmt.b32 d, word, 0, c (default mode)
        out = 0
        for i in range(4):
            nib = (c >> 4 * i) & 0xF
            byte = (word >> 8 * (nib & 7)) & 0xFF if nib & 7 < 4 else 0
            out |= (0xFF if byte & 0x80 else 0) << 8 * i if nib & 8 else byte << 8 * i
        return out

    def bf16(bits):
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]

    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for lo in range(256):
        for hi in (lo, 255 - lo, 0x80, 0x01):
            a = (prmt(lo | hi << 8, sel) << shift) & mask
            for bits, code in ((a & 0xFFFF, lo), (a >> 16, hi)):
                got = bf16(bits) * bf16(big & 0xFFFF)  # exact: a power of two times a short fraction
                if code & 0x7F == 0x7F:
                    assert got == (-480.0 if code & 0x80 else 480.0)
                else:
                    assert got == want[code] and str(got)[0] == str(want[code])[0], hex(code)  # sign of zero too


@pytest.mark.parametrize("variant", ["dequant", "gemv", "mma"])
def test_a_variant_asked_for_by_name_takes_its_own_tiles(variant):
    """At one row the table picks the gemv's tiles (BLOCK_K 512); a variant asked for by name (the H200
    check of wo_a asks for "dequant") takes its own, which the launch accepts, and still matches."""
    from kernels import quant_configs
    from kernels.fused_fp8_linear import tiles

    groups, rows, k = 2, 128, 512
    assert quant_configs.fp8_linear_config(1, rows, k)["variant"] == "gemv"
    got_variant, cfg = tiles(1, rows, k, variant)
    assert got_variant == variant and cfg.get("variant") == variant
    if variant == "dequant":
        assert 128 % cfg["BLOCK_K"] == 0  # inside the 128x128 scale blocks
    x, q, s = _grouped_case(1, groups, rows, k, seed=5)
    want = ref.grouped_linear(x, q, groups, s).float()
    got = fp8_linear_fused(x, q, s, variant=variant, groups=groups).float()
    assert (got - want).abs().max() <= 0.1 * max(want.abs().max().item(), 1.0)


def _case32(m: int, n: int, k: int, seed: int = 0):
    """x and an FP8 weight in DeepSeek-V4.1's 32x32 tiles, the tiles' magnitudes spread over 12 octaves
    so a scale read from the wrong tile shows (ue8m0 scales, float32 as the kernels hold them)."""
    g = torch.Generator().manual_seed(seed + m * 7 + n + k)
    x = torch.randn(m, k, generator=g)
    octaves = torch.randint(-6, 6, (-(-n // 32), -(-k // 32)), generator=g).float()
    w = torch.randn(n, k, generator=g) / k**0.5 * torch.exp2(octaves).repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
    q, s = quantize_fp8_block(w, block=32)
    return x, q, scale_to_float(s)


@pytest.mark.parametrize("variant, m, n, k", [
    (v, *shape) for v in ("gemv", "dequant", "mma")  # one row, a few, several row tiles (the gemv: one row per program)
    for shape in ((1, 96, 200), (3, 130, 257), (2 if v == "gemv" else 40, 160, 384))])
def test_fp8_linear_with_32x32_blocks_matches_reference(variant, m, n, k):
    """V4.1's blocks: the block read from the scale's shape (kernels.formats.fp8_block_of), each
    kernel's K step applying the scales of the 32-wide sub-blocks it spans (interpreter tiles: gemv
    4 per step, dequant 2, mma 4 per 128-wide activation block); split-K 2 for the GEMVs."""
    from kernels.formats import fp8_block_of

    x, q, s = _case32(m, n, k)
    assert fp8_block_of(q.shape, s.shape) == 32
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        want = (ref.linear_act_quant if variant == "mma" else ref.linear)(x.to(dtype), q, s).float()
        got = fp8_linear_fused(x.to(dtype), q, s, variant=variant).float()
        assert (got - want).abs().max() <= tol * want.abs().max(), (dtype, (got - want).abs().max())


@pytest.mark.parametrize("variant, tiles", [("dequant", {"BLOCK_K": 32}), ("dequant", {"BLOCK_K": 16}),
                                            ("dequant", {"BLOCK_K": 128, "SPLIT_K": 3}), ("mma", {"BLOCK_N": 64}),
                                            ("dequant", {"BLOCK_K": 128, "SCALE_TILE": True}),
                                            ("dequant", {"BLOCK_K": 64, "SPLIT_K": 3, "SCALE_TILE": True})])
def test_32x32_blocks_with_other_tiles(monkeypatch, variant, tiles):
    """The other branches: dequant steps inside one 32-wide block (V4's loop with B = 32), a split-K
    boundary inside a step, an mma tile taller than a block (one weight scale per row, not per tile),
    and the dequant step as one MMA over the tile scaled per element (SCALE_TILE), split-K too."""
    from kernels import quant_configs

    monkeypatch.setitem(quant_configs.INTERPRET_LINEAR, variant, {**quant_configs.INTERPRET_LINEAR[variant], **tiles})
    x, q, s = _case32(3, 96, 300, seed=1)
    want = (ref.linear_act_quant if variant == "mma" else ref.linear)(x, q, s)
    got = fp8_linear_fused(x, q, s, variant=variant)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("variant", ["gemv", "dequant", "mma"])
def test_grouped_and_split_linears_with_32x32_blocks(variant):
    """wo_a's groups of 32-row blocks (one launch, or mma one group at a time) and a stacked pair split
    on a 32-row boundary, against the reference; kernels.fused's dispatch takes the 32-row groups too."""
    from kernels.fused import grouped_linear_fused

    groups, rows, k = 3, 32, 160
    _, q, s = _case32(2, groups * rows, k, seed=2)
    x = torch.randn(2, groups, k, generator=torch.Generator().manual_seed(2))
    want = ref.grouped_linear(x, q, groups, s)
    tol = 1e-1 if variant == "mma" else 1e-5  # mma: e4m3 activations
    got = fp8_linear_fused(x, q, s, variant=variant, groups=groups)
    assert (got - want).abs().max() <= tol * want.abs().max()
    if variant == "dequant":  # the dispatch at 2 rows: one launch
        assert (grouped_linear_fused(x, q, groups, s) - want).abs().max() <= 1e-5 * want.abs().max()
    x2 = x[:, 0]
    a, b = fp8_linear_fused(x2, q, s, variant=variant, split_n=64)
    exact = ref.linear_act_quant if variant == "mma" else ref.linear
    ya, yb = exact(x2, q, s).split([64, groups * rows - 64], -1)
    assert (a - ya).abs().max() <= 1e-5 * ya.abs().max() and (b - yb).abs().max() <= 1e-5 * yb.abs().max()


@pytest.mark.parametrize("block, n, k", [(32, 96, 200), (32, 130, 257), (128, 200, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacked_weight_equals_the_formats_dequantizer_exactly(block, n, k, dtype):
    """kernels/fp8_unpack.py: the same float32 product rounded once, bit for bit, on and off the block
    (bf16: within one bf16 step, the interpreter's float32 -> bf16 cast truncating where the GPU's rounds)."""
    from kernels.fp8_unpack import fp8_unpacked

    g = torch.Generator().manual_seed(n + k)
    octaves = torch.randint(-6, 6, (-(-n // block), -(-k // block)), generator=g).float()
    w = torch.randn(n, k, generator=g) * torch.exp2(octaves).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    for ue8m0 in (True, False):
        q, s = quantize_fp8_block(w, ue8m0=ue8m0, block=block)
        s = scale_to_float(s)
        got, want = fp8_unpacked(q, s, dtype).float(), dequantize_fp8_block(q, s)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            assert ((got - want).abs() <= want.abs() * 2.0**-7).all() and (got != 0).sum() == (want != 0).sum()


def test_32x32_blocks_at_prefill_rows_take_the_unpacked_weight():
    """Where the tables pick the tensor-core kernel for a weight in V4.1's 32x32 blocks, the weight is
    unpacked and multiplied by torch's GEMM instead: kernels.reference.linear's result exactly (plain,
    grouped as wo_a, split as a stacked pair); asked for by name, "mma" still runs (its e4m3
    activations differ from the reference); V4's 128x128 blocks keep "mma"."""
    from kernels import quant_configs

    m = 160  # past the default table's decode rows (its shapes'): "mma" (the interpreter runs one tile for every row bound)
    assert variant_for(m, 96, 200) == "mma" and quant_configs.fp8_linear_config(m, 96, 200)["variant"] == "mma"
    x, q, s = _case32(m, 96, 200)
    assert torch.equal(fp8_linear_fused(x, q, s), ref.linear(x, q, s))
    xb = x.to(torch.bfloat16)  # the interpreter's bf16 cast truncates (see the test above)
    want = ref.linear(xb, q, s).float()
    assert (fp8_linear_fused(xb, q, s).float() - want).abs().max() <= 1e-2 * want.abs().max()
    assert not torch.equal(fp8_linear_fused(x, q, s, variant="mma"), ref.linear(x, q, s))
    assert torch.equal(fp8_linear_fused(x, q, s, variant="unpacked"), ref.linear(x, q, s))
    a, b = fp8_linear_fused(x, q, s, split_n=64)
    want = ref.linear(x, q, s)
    assert torch.equal(a, want[:, :64]) and torch.equal(b, want[:, 64:]) and a.is_contiguous() and b.is_contiguous()
    groups, rows = 3, 32
    _, qg, sg = _case32(m, groups * rows, 160, seed=3)
    xg = torch.randn(m, groups, 160, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(fp8_linear_fused(xg, qg, sg, groups=groups), ref.grouped_linear(xg, qg, groups, sg),
                          rtol=1e-5, atol=1e-5)
    x4, q4, s4 = _case(m, 256, 384, ue8m0=True)
    assert torch.equal(fp8_linear_fused(x4, q4, s4), fp8_linear_fused(x4, q4, s4, variant="mma"))


def test_cublas_variant_where_rows_shape_and_device_allow(monkeypatch):
    """V4's 128x128-block linears take cuBLAS's blockwise FP8 GEMM from FP8_CUBLAS_MIN_ROWS rows, in place of the
    table's "mma" or "dequant", only where K has whole groups of 4 scale blocks and on Hopper; a variant asked for
    by name, V4.1's 32x32 blocks, fewer rows, another GPU and the interpreter keep the Triton kernels."""
    from kernels import fused_fp8_linear, quant_configs
    from kernels.fused_fp8_linear import tiles

    assert tiles(300, 1024, 4096)[0] == "dequant"  # the interpreter (CUBLAS_OK off): the table's pick
    monkeypatch.setattr(fused_fp8_linear, "CUBLAS_OK", True)
    monkeypatch.setattr(quant_configs, "hopper", lambda device=None: True)
    rows = quant_configs.FP8_CUBLAS_MIN_ROWS
    assert tiles(rows, 1024, 4096)[0] == "cublas"  # wq_a's table says "dequant" up to 512 rows
    assert tiles(2048, 32768, 1024)[0] == "cublas" and tiles(2048, 4096, 8192)[0] == "cublas"
    assert tiles(rows - 1, 1024, 4096)[0] == "dequant"
    assert tiles(2048, 4096, 256)[0] == "mma"  # a K of 2 scale blocks (shared_w2's shard at 8-way)
    assert tiles(2048, 4096, 4096, variant="mma")[0] == "mma"
    assert tiles(2048, 4096, 4096, block=32)[0] == "unpacked"
    from kernels import variants
    mid = quant_configs.FP8_CUBLAS_MID_ROWS
    assert tiles(mid, 1024, 4096)[0] == "dequant"
    monkeypatch.setattr(variants, "_on", variants._on | {"fp8_cublas_mid"})  # kernel variant fp8_cublas_mid
    assert tiles(mid, 1024, 4096)[0] == "cublas" and tiles(mid - 1, 1024, 4096)[0] == "dequant"
    monkeypatch.setattr(quant_configs, "hopper", lambda device=None: False)
    assert tiles(2048, 4096, 4096)[0] == "mma"


@pytest.mark.parametrize("variant, m", [("gemv", 1), ("gemv", GEMV_ROWS), ("dequant", 5)])
def test_swiglu_prologue_equals_the_two_launches(variant, m):
    """act=(up, limit): the SwiGLU computed in the GEMV's prologue gives what the SwiGLU kernel then the
    linear give (one rounding to bf16 in both), and it clamps (large gate / up values)."""
    from kernels.deepseek_v41.fused import clamped_swiglu_fused

    n, k = 200, 384  # N off the 128 block, K three blocks
    x, q, s = _case(m, n, k, ue8m0=True, seed=5)
    g = torch.Generator().manual_seed(m)
    gate, up = (torch.randn(m, k, generator=g) * 6).bfloat16(), (torch.randn(m, k, generator=g) * 6).bfloat16()
    got = fp8_linear_fused(gate, q, s, variant=variant, act=(up, 10.0))
    act = clamped_swiglu_fused(gate, up, 10.0, out_dtype=torch.bfloat16)
    assert torch.equal(got, fp8_linear_fused(act, q, s, variant=variant))
    want = ref.swiglu_linear(gate, up, 10.0, q, s)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * want.abs().max()


@pytest.mark.parametrize("variant, m", [("gemv", 1), ("gemv", GEMV_ROWS), ("dequant", 5)])
def test_rms_norm_prologue_equals_the_two_launches(variant, m):
    """norm=(weight, eps): the RMSNorm computed in the GEMV's prologue (every split reads the whole row's sum of
    squares) gives what the RMSNorm kernel then the linear give, up to the sum's order (one bf16 step of an
    activation at most), on rows of very different scales."""
    from kernels.fused_norm_mhc import rms_norm_fused

    n, k = 200, 384  # N off the 128 block, K three blocks
    _, q, s = _case(m, n, k, ue8m0=True, seed=7)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).bfloat16()
    nw = torch.rand(k, generator=g) + 0.5
    got = fp8_linear_fused(x, q, s, variant=variant, norm=(nw, 1e-6))
    two = fp8_linear_fused(rms_norm_fused(x, nw, 1e-6), q, s, variant=variant)
    want = ref.norm_linear(x, nw, 1e-6, q, s)
    scale = want.float().abs().amax(dim=1, keepdim=True)
    assert ((got.float() - two.float()).abs() <= 1e-2 * scale).all()
    assert ((got.float() - want.float()).abs() <= 3e-2 * scale).all()


def test_rms_norm_prologue_refuses_what_it_cannot_take():
    x, q, s = _case(1, 128, 256, ue8m0=True)
    with pytest.raises(ValueError, match="RMSNorm prologue"):
        fp8_linear_fused(x, q, s, norm=(torch.ones(128), 1e-6))  # weight of the wrong width
    with pytest.raises(ValueError, match="gemv or dequant"):
        fp8_linear_fused(x, q, s, variant="mma", norm=(torch.ones(256), 1e-6))


def test_norm_linear_takes_the_prologue_only_with_its_switch():
    """kernels.fused.norm_linear_fused: the RMSNorm kernel then the linear, or with q_norm_gemv one GEMV whose
    prologue norms (the same values as fp8_linear_fused's norm=)."""
    from kernels import fusions
    from kernels.fused import norm_linear_fused
    from kernels.fused_norm_mhc import rms_norm_fused

    x, q, s = _case(1, 128, 256, ue8m0=True, seed=9)
    x, nw = x.bfloat16(), torch.rand(256) + 0.5
    try:
        fusions.set_fusions("q_norm_gemv")
        assert torch.equal(norm_linear_fused(x, nw, 1e-6, q, s), fp8_linear_fused(x, q, s, norm=(nw, 1e-6)))
        fusions.set_fusions("")
        assert torch.equal(norm_linear_fused(x, nw, 1e-6, q, s), fp8_linear_fused(rms_norm_fused(x, nw, 1e-6), q, s))
    finally:
        fusions.set_fusions(fusions.DEFAULT)
