"""Fused lightning-indexer scores and selection vs the reference: a prefill chunk and decodes of
several sequences in one packed batch, paged keys, top-k above what is visible, nothing visible."""

import pytest
import torch

from kernels import indexer_select
from kernels import reference as ref
from kernels.fused_indexer import indexer_scores_paged, indexer_topk_fused
from kernels.indexer_select import indexer_topk_select


def _batch(spec, H, d, ratio, bs, dtype, seed):
    """spec: (first position, n tokens) per sequence; tables are random block permutations."""
    g = torch.Generator().manual_seed(seed)
    nb, per_block = 40, bs // ratio
    pool = torch.randn(nb, per_block, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables, pos, seq = [], [], []
    for s, (start, n) in enumerate(spec):
        tables.append(perm[s * 10: s * 10 + (start + n) // bs + 1].tolist())
        pos += range(start, start + n)
        seq += [s] * n
    width = max(map(len, tables))
    t = lambda x: torch.tensor(x, dtype=torch.long)
    ft = t([r + [0] * (width - len(r)) for r in tables])
    iq = torch.randn(len(pos), H, d, generator=g).to(dtype)
    iw = torch.randn(len(pos), H, generator=g) * H**-0.5
    return iq, iw, pool, ft, t(pos), t(seq)


SPECS = [
    [(0, 3)],  # nothing visible yet
    [(70, 1), (3, 40), (130, 1)],  # decodes around a 40-token prefill chunk crossing blocks
    [(200, 1), (33, 1), (90, 1)],  # a decode batch
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("spec", SPECS)
def test_indexer_scores_and_selection(dtype, tol, spec):
    H, d, ratio, bs, topk = 6, 16, 4, 32, 8
    iq, iw, pool, ft, pos, seq = _batch(spec, H, d, ratio, bs, dtype, seed=len(spec))
    max_pos = int(pos.max())
    n = (max_pos + 1) // ratio
    if n:  # the scores themselves, row by row against the reference's formula
        scores = indexer_scores_paged(iq, iw, pool, ft, pos, seq, ratio, n)
        for t in range(pos.shape[0]):
            vis = (int(pos[t]) + 1) // ratio
            e = torch.arange(vis)
            keys = pool.view(-1, d)[ft[seq[t], e // (bs // ratio)] * (bs // ratio) + e % (bs // ratio)]
            want = ref.indexer_scores(iq[t:t + 1], keys, iw[t:t + 1], d)[0]
            scale = max(want.abs().max().item(), 1.0) if vis else 1.0
            assert (scores[t, :vis] - want).abs().max().item() <= tol * scale if vis else True
            assert torch.isinf(scores[t, vis:]).all()
    want = ref.indexer_topk(iq, iw, pool, ft, pos, seq, ratio, topk, max_pos)
    got = indexer_topk_fused(iq, iw, pool, ft, pos, seq, ratio, topk, max_pos)
    assert got.shape == want.shape
    for t in range(pos.shape[0]):  # the same set of entries (order within top-k is free)
        assert sorted(got[t].tolist()) == sorted(want[t].tolist()), t


def test_sort_and_torch_topk_paths_agree_and_put_valid_picks_first(monkeypatch):
    import kernels.fused_indexer as fi
    iq, iw, pool, ft, pos, seq = _batch(SPECS[1], 6, 16, 4, 32, torch.float32, seed=9)
    args = (iq, iw, pool, ft, pos, seq, 4, 8, int(pos.max()))
    by_sort = fi.indexer_topk_fused(*args)
    monkeypatch.setattr(fi, "SORT_MAX", 4)  # rows longer than this go through torch.topk
    by_torch = fi.indexer_topk_fused(*args)
    for t in range(pos.shape[0]):
        row = by_sort[t].tolist()
        assert sorted(row) == sorted(by_torch[t].tolist())
        n_valid = sum(v >= 0 for v in row)
        assert n_valid == min(8, (int(pos[t]) + 1) // 4) and all(v >= 0 for v in row[:n_valid])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_paged_scores_reference_matches_the_kernel(dtype, tol):
    """reference.indexer_scores_paged (the decode batch's scores, the spec V4.1's two-level top-k
    reads) vs the kernel: finite values within tol of the scale, -inf exactly where not visible."""
    H, d, ratio, bs = 6, 16, 2, 32
    iq, iw, pool, ft, pos, seq = _batch(SPECS[2], H, d, ratio, bs, dtype, seed=5)
    n = (int(pos.max()) + 1) // ratio + 3  # padded past the longest, as a graph's rows are
    want = ref.indexer_scores_paged(iq, iw, pool, ft, pos, seq, ratio, n)
    got = indexer_scores_paged(iq, iw, pool, ft, pos, seq, ratio, n)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert (got[fin] - want[fin]).abs().max() <= tol * max(want[fin].abs().max(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_weights_as_a_strided_slice_with_their_scale_inside(dtype):
    """The model's head weights: a column slice of the stacked GEMM's output in the model dtype, their
    H^-0.5 scale applied in the kernel (iw_scale). The same fp32 product as scaling them first in torch,
    so the scores are bitwise those of the pre-scaled contiguous weights; the reference agrees too."""
    H, d, ratio, bs = 6, 16, 4, 32
    # the decode batch (3 rows, not the prefill spec's 42): the stride and the scale are the same code at any
    # row count, and under the interpreter the kernels' cost is their rows
    iq, _, pool, ft, pos, seq = _batch(SPECS[2], H, d, ratio, bs, torch.float32, seed=3)
    wide = torch.randn(pos.shape[0], H + 9, generator=torch.Generator().manual_seed(1)).to(dtype)
    raw = wide[:, 5:5 + H]  # row stride H + 9
    n = (int(pos.max()) + 1) // ratio
    scaled = raw.float() * H**-0.5
    want = indexer_scores_paged(iq, scaled, pool, ft, pos, seq, ratio, n)
    assert torch.equal(indexer_scores_paged(iq, raw, pool, ft, pos, seq, ratio, n, H**-0.5), want)
    assert torch.equal(ref.indexer_scores_paged(iq, raw, pool, ft, pos, seq, ratio, n, H**-0.5),
                       ref.indexer_scores_paged(iq, scaled, pool, ft, pos, seq, ratio, n))
    args = (iq, raw, pool, ft, pos, seq, ratio, 8, int(pos.max()))
    assert torch.equal(indexer_topk_fused(*args, iw_scale=H**-0.5),
                       indexer_topk_fused(iq, scaled, *args[2:]))
    assert torch.equal(ref.indexer_topk(*args, iw_scale=H**-0.5), ref.indexer_topk(iq, scaled, *args[2:]))


@pytest.mark.parametrize("select", ["reference", "fused", "radix"])
def test_exact_ties_pick_the_same_entries_alone_and_batched(select):
    """Zero keys score exactly 0 (-0.0 with negative head weights): the best entries, tied. A sequence's
    selection must not depend on the batch it runs in (its row padded to a longer sequence's entries):
    every path takes the lowest tied indices. torch.topk's own tie order changed with the row's length
    and flipped a greedy token of the tiny preset batched vs alone."""
    H, d, ratio, bs, topk = 6, 16, 4, 32, 4
    iq, iw, pool, ft, pos, seq = _batch([(76, 1), (200, 1)], H, d, ratio, bs, torch.float32, seed=2)
    iw = -iw.abs()  # every other entry scores below 0
    tied = [1, 3, 7, 11, 12, 15, 18]
    per_block = bs // ratio
    pool.view(-1, d)[ref._entry_slots(ft[0], per_block, torch.tensor(tied))] = 0.0
    fn = {"reference": ref.indexer_topk, "fused": indexer_topk_fused, "radix": indexer_topk_select}[select]
    alone = fn(iq[:1], iw[:1], pool, ft, pos[:1], seq[:1], ratio, topk, int(pos[0]), one_per_seq=True)
    batched = fn(iq, iw, pool, ft, pos, seq, ratio, topk, int(pos.max()), one_per_seq=True)
    prefill_path = fn(iq, iw, pool, ft, pos, seq, ratio, topk, int(pos.max()))
    assert alone[0].tolist() == batched[0].tolist() == prefill_path[0].tolist() == tied[:topk]


@pytest.mark.parametrize("graph_sized", [False, True])
def test_a_token_that_sees_at_most_topk_entries_picks_them_all_unscored(graph_sized):
    """Up to topk visible entries the top-k is every one of them whatever they score: the fused path picks them in
    index order without scoring them (NaN queries here change nothing), deciding per token on the GPU where the
    rows are sized for a longer sequence (graph_sized: as CUDA graphs call it), while a token that sees more still
    ranks its entries (the reference's set)."""
    H, d, ratio, bs, topk = 6, 16, 4, 32, 8
    iq, iw, pool, ft, pos, seq = _batch(SPECS[1], H, d, ratio, bs, torch.float32, seed=4)
    max_pos = 400 if graph_sized else int(pos.max())  # 400: rows of 100 entries, past every token here
    want = ref.indexer_topk(iq, iw, pool, ft, pos, seq, ratio, topk, max_pos)
    fits = ((pos + 1) // ratio) <= topk
    assert fits.any() and not fits.all()
    nan_q = torch.where(fits[:, None, None], float("nan"), iq)  # a fitting token's query never reaches a score
    got = indexer_topk_fused(nan_q, iw, pool, ft, pos, seq, ratio, topk, max_pos)
    for t in range(pos.shape[0]):
        n_vis = (int(pos[t]) + 1) // ratio
        if fits[t]:
            assert got[t].tolist() == list(range(n_vis)) + [-1] * (topk - n_vis), t
        else:
            assert sorted(got[t].tolist()) == sorted(want[t].tolist()), t
    short = pos < topk * ratio - 1  # a prefill where no token sees more than topk: no scores at all
    alone = indexer_topk_fused(torch.full_like(iq[short], float("nan")), iw[short], pool, ft, pos[short], seq[short],
                               ratio, topk, int(pos[short].max()))
    assert torch.equal(alone, got[short])


@pytest.mark.parametrize("spec", SPECS + [[(300, 2), (500, 1), (7, 30)]])
@pytest.mark.parametrize("graph_sized", [False, True])
def test_radix_select_picks_the_reference_set(spec, graph_sized, monkeypatch):
    """Kernel variant indexer_select: each token scores what it sees and a radix select picks its top-k, the
    reference's set (ties at the threshold: the lower indices), whatever the row width (graph_sized: rows for a
    sequence of 2,000 positions, as a CUDA graph's) and across several passes of a token's entries (chunks of 16
    here). Up to 16 entries seen (SORT_SEEN here) a token's picks come from a sort instead, best first. Negative head
    weights give negative scores, and the relu's zeros give -0.0 against +0.0."""
    monkeypatch.setattr(indexer_select, "CHUNK", 16)
    monkeypatch.setattr(indexer_select, "SORT_SEEN", 16)
    iq, iw, pool, ft, pos, seq = _batch(spec, 6, 16, 4, 32, torch.float32, seed=len(spec) + 11)
    iw[::2] = -iw[::2].abs()
    max_pos = 2000 if graph_sized else int(pos.max())
    for topk in (4, 8):
        want = ref.indexer_topk(iq, iw, pool, ft, pos, seq, 4, topk, max_pos)
        got = indexer_topk_select(iq, iw, pool, ft, pos, seq, 4, topk, max_pos)
        for t in range(pos.shape[0]):
            row = got[t].tolist()
            assert sorted(row) == sorted(want[t].tolist()), (topk, t)
            picks = [v for v in row if v >= 0]
            assert all(v >= 0 for v in row[:len(picks)])  # the picks first, then the -1 padding
            if (int(pos[t]) + 1) // 4 > 16:  # the radix select's: in index order
                assert picks == sorted(picks)


def test_the_variant_routes_the_models_selection(monkeypatch):
    """kernels.indexer_topk (the CUDA dispatch) takes the radix select with the variant on, the fused sort without,
    and the radix select without the variant where rows are longer than SORT_MAX (a server past 16K-token contexts:
    the sort path's torch.topk over the whole row measured 1.17-780x slower)."""
    from kernels import fused, variants

    calls = []
    monkeypatch.setattr(fused, "indexer_topk_select", lambda *a, **k: calls.append("radix"))
    monkeypatch.setattr(fused, "indexer_topk_fused", lambda *a, **k: calls.append("sort"))
    args = _batch(SPECS[2], 6, 16, 4, 32, torch.float32, seed=1)
    for on in (False, True):
        monkeypatch.setattr(variants, "_on", frozenset({"indexer_select"} if on else ()))
        fused.indexer_topk_switched(*args, 4, 8, 300)
    monkeypatch.setattr(variants, "_on", frozenset())
    for max_pos in (4 * fused.SORT_MAX - 1, 4 * fused.SORT_MAX + 3):  # rows of SORT_MAX entries, then SORT_MAX + 1
        fused.indexer_topk_switched(*args, 4, 8, max_pos)
    assert calls == ["sort", "radix", "sort", "radix"]
    assert fused.FUSED["indexer_topk"] is fused.indexer_topk_switched  # what the model's kernels.indexer_topk runs
