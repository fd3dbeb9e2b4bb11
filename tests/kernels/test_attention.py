"""Fused paged attention vs the torch reference: window boundaries, replay_start, one token,
HCA dense entries, CSA selections with -1 padding (top-k larger than what is visible)."""

import pytest
import torch

from kernels import reference as ref
from kernels.fused_attention import paged_attention_fused


def _setup(seq_specs, H, hd, W, bs, ratio, dtype, seed):
    """seq_specs: list of (first position, n query tokens, replay_start). Random pools; tables
    are random permutations of blocks so paging is exercised."""
    g = torch.Generator().manual_seed(seed)
    nb = 64
    window = torch.randn(nb, bs, hd, generator=g).to(dtype)
    per_block = bs // ratio if ratio else 1
    comp = torch.randn(nb, per_block, hd, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    wt, ft, pos, seq, rs = [], [], [], [], []
    for s, (start, n, replay) in enumerate(seq_specs):
        blocks = (start + n) // bs + 1
        wt.append(perm[s * 8: s * 8 + blocks].tolist())
        ft.append(perm[32 + s * 8: 32 + s * 8 + blocks].tolist())
        pos += list(range(start, start + n))
        seq += [s] * n
        rs.append(replay)
    width = max(len(r) for r in wt)
    t = lambda x: torch.tensor(x, dtype=torch.long)
    wt = t([r + [-1] * (width - len(r)) for r in wt])
    ft = t([r + [0] * (width - len(r)) for r in ft])
    q = torch.randn(len(pos), H, hd, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g)
    return q, t(pos), t(seq), window, wt, t(rs), comp, ft, sinks


def _selection(pos, ratio, seed=3):
    """A CSA selection of up to 6 visible entries per token, -1 padded (top-k > available)."""
    g = torch.Generator().manual_seed(seed)
    selected = torch.full((len(pos), 6), -1, dtype=torch.long)
    for i, p in enumerate(pos.tolist()):
        n_vis = (p + 1) // ratio
        pick = torch.randperm(max(n_vis, 1), generator=g)[: min(n_vis, 6)]
        selected[i, : len(pick)] = pick
    return selected


SPECS = [
    [(0, 1, 0)],  # one token, first position
    [(5, 1, 0), (40, 1, 0), (17, 9, 0)],  # decodes and a prefill chunk across the window boundary
    [(30, 12, 20), (63, 1, 50)],  # bounded replay: nothing below replay_start
]


# float32 on every spec (the masks, windows and replay starts, to float32 rounding); bfloat16 on the spec with
# decodes and a prefill chunk only: its loads, casts and stores are the same code on every spec
DTYPE_SPECS = [(torch.float32, 1e-5, spec) for spec in SPECS] + [(torch.bfloat16, 2e-2, SPECS[1])]


@pytest.mark.parametrize("dtype, tol, spec", DTYPE_SPECS)
@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("nsplit, block_h, wgmma_tiles", [(1, 16, None), (4, 16, None), (1, 32, None),
                                                             (None, None, (16, 16, 4, None, 3)),
                                                             (None, None, (16, 32, 4, 16, 2))])
def test_paged_attention(dtype, tol, spec, mode, nsplit, block_h, wgmma_tiles):
    """The small tiles at several splits and head blocks, and the wgmma tiles (splits chosen by the rule), whole and
    with the output columns split over programs."""
    H, hd, W, bs, ratio = 5, 32, 16, 16, (0 if mode == "sliding" else 4)
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(spec, H, hd, W, bs, ratio or 1, dtype, seed=len(spec))
    selected = _selection(pos, ratio) if mode == "csa" else None
    args = (q, pos, seq, window, wt, rs, W, None if mode == "sliding" else comp, ft, ratio, selected, sinks, 32**-0.5)
    want = ref.paged_attention(*args)
    got = paged_attention_fused(*args, nsplit=nsplit, block_h=block_h, wgmma_tiles=wgmma_tiles)
    assert (got.float() - want.float()).abs().max() <= tol * max(want.abs().max().item(), 1.0)


def test_prefill_chunks_take_the_wgmma_tiles(monkeypatch):
    """From PREFILL_T tokens the default dispatch takes the whole-head tiles (no tiles asked for), and it matches
    the reference; asking for the small tiles keeps them."""
    import kernels.fused_attention as fa

    ran = []
    real = fa._wgmma_tiles
    monkeypatch.setattr(fa, "_wgmma_tiles", lambda *a: ran.append(real(*a)) or real(*a))
    monkeypatch.setattr(fa, "PREFILL_T", 8)
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(SPECS[1], 5, 32, 16, 16, 4, torch.float32, seed=7)
    args = (q, pos, seq, window, wt, rs, 16, comp, ft, 4, None, sinks, 32**-0.5)  # HCA
    got = paged_attention_fused(*args)
    assert ran == [(16, 32, 4, 32, 3)]  # the small-head tiles, whole head_dim
    assert (got - ref.paged_attention(*args)).abs().max() <= 1e-5 * max(got.abs().max().item(), 1.0)
    paged_attention_fused(*args, nsplit=1, block_h=16)
    assert len(ran) == 1


def test_split_combine_in_column_slices(monkeypatch):
    """The split-K combine with each program taking a slice of the heads and of the columns (the GPU's 8 x 128 of
    a 64 x 512 token) matches the reference."""
    import kernels.fused_attention as fa

    monkeypatch.setattr(fa, "COMBINE_BLOCK_H", 2)
    monkeypatch.setattr(fa, "COMBINE_BLOCK_D", 8)
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(SPECS[1], 5, 32, 16, 16, 4, torch.float32, seed=5)
    args = (q, pos, seq, window, wt, rs, 16, comp, ft, 4, None, sinks, 32**-0.5)
    got = paged_attention_fused(*args, nsplit=4)
    assert (got - ref.paged_attention(*args)).abs().max() <= 1e-5 * max(got.abs().max().item(), 1.0)


def test_pools_one_pointer_cannot_reach_are_refused():
    """The kernel reads both pools through the window pool's pointer: a compressed pool of another dtype gets a clear
    error, not a wrong read."""
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(SPECS[0], 5, 32, 16, 16, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_fused(q, pos, seq, window, wt, rs, 16, comp.double(), ft, 4, None, sinks, 32**-0.5)


@pytest.mark.parametrize("nsplit, wgmma_tiles", [(1, None), (2, None), (None, (16, 16, 4, 16, 2))])
def test_inverse_rope_in_the_store_equals_the_rotation_launch(nsplit, wgmma_tiles):
    """inv_rope_out (kernels/fusions.py): the output's inverse RoPE in the attention's store (one split), its
    combine's (two) or a column tile's (wgmma, 16-column tiles: the rotation in the last two) equals the
    attention then kernels.fused_rope's launch, bit for bit, and the reference with inv_rope."""
    from kernels import fusions
    from kernels.fused_rope import apply_rope_fused

    H, hd, W, bs, r = 5, 32, 16, 16, 8
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(SPECS[1], H, hd, W, bs, 4, torch.bfloat16, seed=11)
    ang = pos[:, None].float() * torch.rand(r // 2, generator=torch.Generator().manual_seed(2))[None, :]
    inv = (ang.cos().bfloat16(), -ang.sin().bfloat16())
    args = (q, pos, seq, window, wt, rs, W, comp, ft, 4, None, sinks, 32**-0.5)
    tiles = {"nsplit": nsplit, "wgmma_tiles": wgmma_tiles}
    try:
        fusions.set_fusions("inv_rope_out")
        got = paged_attention_fused(*args, **tiles, inv_rope=inv)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    plain = paged_attention_fused(*args, **tiles)
    assert torch.equal(got, apply_rope_fused(plain, *inv))
    assert not torch.equal(got[..., -r:], plain[..., -r:]) and torch.equal(got[..., :-r], plain[..., :-r])
    want = ref.paged_attention(*args, inv_rope=inv)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("mode, inv", [("hca", False), ("csa", True)])
def test_combine_by_the_last_split_equals_the_combine_launch(monkeypatch, mode, inv):
    """combine_last (kernels/fusions.py): the last split of each (token, head block) to finish joins the partials,
    in the combine's head x column slices (2 x 8 here: several of each per program), with the inverse RoPE where
    asked: bit for bit what the combine launch gives, and the counters are left zero for the next launch."""
    import kernels.fused_attention as fa
    from kernels import fusions
    from kernels.semaphores import all_zero

    monkeypatch.setattr(fa, "COMBINE_BLOCK_H", 2)
    monkeypatch.setattr(fa, "COMBINE_BLOCK_D", 8)
    H, hd, W, bs, r = 5, 32, 16, 16, 8
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(SPECS[1], H, hd, W, bs, 4, torch.bfloat16, seed=13)
    sel = _selection(pos, 4, seed=4) if mode == "csa" else None
    ang = pos[:, None].float() * torch.rand(r // 2, generator=torch.Generator().manual_seed(2))[None, :]
    kw = {"nsplit": 4, "inv_rope": (ang.cos().bfloat16(), -ang.sin().bfloat16()) if inv else None}
    args = (q, pos, seq, window, wt, rs, W, comp, ft, 4, sel, sinks, 32**-0.5)
    ran = []
    monkeypatch.setattr(fa._combine_kernel, "run", lambda *a, **k: ran.append(1))  # the launch must not run
    try:
        fusions.set_fusions("combine_last,inv_rope_out")
        got = paged_attention_fused(*args, **kw)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    assert not ran and all_zero()
    monkeypatch.undo()
    monkeypatch.setattr(fa, "COMBINE_BLOCK_H", 2)
    monkeypatch.setattr(fa, "COMBINE_BLOCK_D", 8)
    try:
        fusions.set_fusions("inv_rope_out")
        want = paged_attention_fused(*args, **kw)
    finally:
        fusions.set_fusions(fusions.DEFAULT)
    assert torch.equal(got, want)
    ref_out = ref.paged_attention(*args, inv_rope=kw["inv_rope"])
    assert (got.float() - ref_out.float()).abs().max() <= 2e-2 * ref_out.abs().max()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("wgmma_tiles", [(16, 16, 4, None, 3), (16, 32, 4, 16, 2)])
def test_slot_offsets_variant_reads_the_same_keys(spec, mode, wgmma_tiles, monkeypatch):
    """Kernel variant attn_offsets: on CSA layers the wgmma tiles read each slot's key row from the table
    _slot_offsets writes (the window's rows past replay_start, the picks' rows, NO_KEY for the -1 padding) and give
    the reference's output; window and HCA layers keep working their rows out in the loop."""
    import kernels.fused_attention as fa
    from kernels import variants

    written = []
    real = fa._slot_offsets
    monkeypatch.setattr(fa, "_slot_offsets", lambda *a: written.append(real(*a)) or written[-1])
    monkeypatch.setattr(variants, "_on", variants._on | {"attn_offsets"})
    H, hd, W, bs, ratio = 5, 32, 16, 16, (0 if mode == "sliding" else 4)
    q, pos, seq, window, wt, rs, comp, ft, sinks = _setup(spec, H, hd, W, bs, ratio or 1, torch.float32,
                                                          seed=len(spec))
    selected = _selection(pos, ratio) if mode == "csa" else None
    args = (q, pos, seq, window, wt, rs, W, None if mode == "sliding" else comp, ft, ratio, selected, sinks, 32**-0.5)
    want = ref.paged_attention(*args)
    got = paged_attention_fused(*args, wgmma_tiles=wgmma_tiles)
    assert (got.float() - want.float()).abs().max() <= 1e-5 * max(want.abs().max().item(), 1.0)
    assert len(written) == (mode == "csa")
    if written:  # one row a token: its window slots, then its picks', NO_KEY (odd) where it has none
        has_key = written[0] % 2 == 0
        assert has_key.shape == (pos.shape[0], W + 6)
        for t in range(pos.shape[0]):
            n_win = int(pos[t]) + 1 - max(int(pos[t]) - W + 1, int(rs[int(seq[t])]), 0)
            assert has_key[t].tolist() == [True] * n_win + (selected[t] >= 0).tolist() + [False] * (W - n_win)
