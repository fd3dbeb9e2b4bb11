"""Fused norm + RoPE kernels vs the references: q (per-head unweighted), kv (weighted, into
the window cache), plain and inverse RoPE; odd token counts, one token."""

import contextlib

import pytest
import torch

from kernels import reference as ref
from kernels import variants
from kernels.fused_rope import apply_rope_fused, kv_norm_rope_insert_fused, norm_rope_fused


def _cos_sin(T, r, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    return ref.rope_cos_sin(torch.randint(0, 5000, (T,)), inv, dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T, H, d, r", [(1, 4, 32, 8), (7, 3, 64, 16), (5, 1, 48, 8)])
def test_q_norm_rope_and_inverse(dtype, tol, T, H, d, r):
    x = torch.randn(T, H, d).to(dtype)
    cos, sin = _cos_sin(T, r, dtype)
    got, want = norm_rope_fused(x, None, cos, sin, 1e-6), ref.norm_rope(x, None, cos, sin, 1e-6)
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max()
    inv = apply_rope_fused(got, cos, -sin)  # the output's inverse rotation undoes it
    assert (inv.float() - ref.apply_rope(got, cos, -sin).float()).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kv_norm_rope_insert_writes_only_its_slots(dtype, tol):
    T, d, r, nb, bs = 9, 32, 8, 4, 16
    kv, w = torch.randn(T, d).to(dtype), torch.rand(d) + 0.5
    cos, sin = _cos_sin(T, r, dtype)
    slots = torch.randperm(nb * bs)[:T]
    pools = [torch.full((nb, bs, d), 7.0, dtype=dtype) for _ in range(2)]
    kv_norm_rope_insert_fused(kv, w, cos, sin, 1e-6, pools[0], slots)
    ref.kv_norm_rope_insert(kv, w, cos, sin, 1e-6, pools[1], slots)
    assert (pools[0].float() - pools[1].float()).abs().max() <= tol * 7
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (pools[0].view(-1, d)[untouched] == 7.0).all()


@pytest.mark.parametrize("T, H", [(1, 4), (5, 3)])
def test_q_and_kv_in_one_launch_equal_the_two(T, H):
    """q_kv_rope (kernels/fusions.py): the query heads and the K=V latent in one launch write what the two
    launches write (bits: the same row code), and the cache only at the slots."""
    from kernels import fusions
    from kernels.fused_rope import q_kv_norm_rope_fused

    d, r, nb, bs = 32, 8, 4, 16
    q, kv, w = torch.randn(T, H, d).bfloat16(), torch.randn(T, d).bfloat16(), torch.rand(d) + 0.5
    cos, sin = _cos_sin(T, r, torch.bfloat16)
    slots = torch.randperm(nb * bs)[:T]
    pools = [torch.full((nb, bs, d), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    try:
        fusions.set_fusions("q_kv_rope")
        got = q_kv_norm_rope_fused(q, kv, w, cos, sin, 1e-6, pools[0], slots)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    want = q_kv_norm_rope_fused(q, kv, w, cos, sin, 1e-6, pools[1], slots)  # switch off: the two launches
    assert torch.equal(got, want) and torch.equal(pools[0], pools[1])
    assert not torch.equal(pools[0], torch.full_like(pools[0], 7.0))
    ref_q = ref.q_kv_norm_rope(q, kv, w, cos, sin, 1e-6, torch.full_like(pools[1], 7.0), slots)
    assert (got.float() - ref_q.float()).abs().max() <= 2e-2 * ref_q.abs().max()


@contextlib.contextmanager
def _rope_tiles(monkeypatch, rows):
    """The variant rope_tiles on, `rows` rows per program whatever the row count (the rule gives its fewest at
    these sizes)."""
    from kernels import fused_rope, variants

    monkeypatch.setattr(fused_rope, "ROPE_TILE_PROGRAMS", 1)
    monkeypatch.setattr(fused_rope, "ROPE_TILE_ROWS", rows)
    try:
        variants.set_variants("rope_tiles")
        yield
    finally:
        variants.set_variants(variants.DEFAULT)


def _every_entry(q, kv, w, cos, sin, slots, pool_shape):
    """What each entry point writes: q norm + RoPE, the inverse RoPE (plain, and V4.1's with sin_sign -1), the kv
    insert's cache, and q + kv in one launch (its q and cache)."""
    from kernels import fusions
    from kernels.deepseek_v41.fused import rope_fused
    from kernels.fused_rope import q_kv_norm_rope_fused

    pools = [torch.full(pool_shape, 7.0, dtype=q.dtype) for _ in range(2)]
    kv_norm_rope_insert_fused(kv, w, cos, sin, 1e-6, pools[0], slots)
    try:
        fusions.set_fusions("q_kv_rope")
        q_kv = q_kv_norm_rope_fused(q, kv, w, cos, sin, 1e-6, pools[1], slots)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    return {"norm_rope": norm_rope_fused(q, None, cos, sin, 1e-6), "apply_rope": apply_rope_fused(q, cos, -sin),
            "v41_inverse": rope_fused(q, cos, sin, inverse=True), "kv_insert": pools[0], "q_kv": q_kv,
            "q_kv_cache": pools[1]}


@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, H, d, r", [(7, 3, 64, 16),  # 21 rows: a partial last tile
                                        (1, 4, 48, 8),  # D off a power of two, fewer rows than a tile
                                        (3, 2, 41, 8)])  # an odd nope: the row kernel still (pairs off the rows')
def test_rope_tiles_write_what_the_row_kernel_writes(monkeypatch, rows, dtype, T, H, d, r):
    """The same arithmetic per element, so the same bits (the interpreter sums each row in the same order; on the
    GPU a row's sum of squares may round otherwise: suite prefill_small_ops checks one bf16 rounding there); the
    cache only at the slots."""
    torch.manual_seed(T * H + d)
    nb, bs = 4, 16
    q, kv, w = torch.randn(T, H, d).to(dtype), torch.randn(T, d).to(dtype), torch.rand(d) + 0.5
    cos, sin = _cos_sin(T, r, dtype)
    slots = torch.randperm(nb * bs)[:T]
    variants.set_variants(())  # the row kernels (rope_tiles is on by default; the test's fixture restores it)
    want = _every_entry(q, kv, w, cos, sin, slots, (nb, bs, d))
    with _rope_tiles(monkeypatch, rows):
        got = _every_entry(q, kv, w, cos, sin, slots, (nb, bs, d))
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ref_q = ref.norm_rope(q, None, cos, sin, 1e-6)
    assert (got["norm_rope"].float() - ref_q.float()).abs().max() <= 2e-2 * ref_q.abs().max()
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (got["kv_insert"].view(-1, d)[untouched] == 7.0).all() and (got["kv_insert"].view(-1, d)[slots] != 7.0).any()


def test_rope_tile_rows_fewest_at_decode_the_widest_at_prefill():
    from kernels.fused_rope import ROPE_TILE_MIN_ROWS, ROPE_TILE_PROGRAMS, ROPE_TILE_ROWS, tile_rows

    assert tile_rows(64) == tile_rows(150 * 64) == ROPE_TILE_MIN_ROWS  # decode's batches of 64 query heads a token
    assert tile_rows(2048 * 64) == ROPE_TILE_ROWS
    widths = [tile_rows(n) for n in (1, 64, 2048, 9600, 131072)]
    assert widths == sorted(widths) and all(w & (w - 1) == 0 for w in widths)  # grows with the rows, powers of 2
    assert all(-(-n // tile_rows(n)) >= ROPE_TILE_PROGRAMS for n in (9600, 131072))  # still enough programs
