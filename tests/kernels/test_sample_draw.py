"""The sampled rows' draw (kernels/fused_draw.py, one program a row, and kernels/fused_draw_wide.py, a row over many
programs; under TRITON_INTERPRET=1) against its torch reference
(kernels.reference.sample_draw / sample_filter): the same token and the same kept set (its cut) for every option
alone and together, on sizes that walk each branch of the search (several probe passes, the gathered and sorted
bracket, a bracket of one value, fewer kept than k), with ties, NaN, +inf and all -inf rows; and the reference's own
meaning: ties kept together at top-k's and top-p's edges, and draws that follow the distribution.

Where rounding decides (u x the kept mass within float32 rounding of a token's edge, top-p's mass within rounding
of top_p, a probability within rounding of min_p's bar) the two may part; such rows are skipped, and the tests
check that they are few."""

import pytest
import torch

from kernels import reference as ref
from kernels.fused_draw import sample_draw_fused
from kernels.fused_draw_wide import sample_draw_wide

SIZES = [dict(block=64, search_block=16, probes=2, cap=8), dict(block=128, search_block=32, probes=4, cap=32),
         dict(block=256, search_block=64, probes=8, cap=128)]
# the wide draw: one pass launched (most searches finish in the row program), two, three with wider segments
WIDE_SIZES = [dict(segment=64, block=32, search_block=16, probes=2, passes=1, cap=8),
              dict(segment=128, block=64, search_block=32, probes=4, passes=2, cap=32),
              dict(segment=256, block=128, search_block=64, probes=8, passes=3, cap=128)]
DRAWS = [(sample_draw_fused, s) for s in SIZES] + [(sample_draw_wide, s) for s in WIDE_SIZES]
DRAW_IDS = [f"one-program-{i}" for i in range(len(SIZES))] + [f"wide-{i}" for i in range(len(WIDE_SIZES))]
OPTIONS = ["temperature", "top_k", "top_p", "min_p", "all"]


def _rows(n: int, V: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 3
    if ties:  # a coarse grid: groups of equal logits far larger than the smallest cap
        x = (x * 2).round() / 2
    x[:, :3] += 6  # a few likely tokens, as a language model's rows
    return x


def _options(n: int, V: int, which: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    temp = torch.tensor([0.5, 1.0, 1.7, 0.8])[torch.randint(0, 4, (n,), generator=g)]
    top_k = torch.tensor([1, 2, 5, 40, V // 2, V - 1])[torch.randint(0, 6, (n,), generator=g)]
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.99, 1.0])[torch.randint(0, 5, (n,), generator=g)]
    min_p = torch.tensor([0.0, 0.01, 0.2])[torch.randint(0, 3, (n,), generator=g)]
    return (temp, top_k if which in ("top_k", "all") else None, top_p if which in ("top_p", "all") else None,
            min_p if which in ("min_p", "all") else None)


def _decided(x: torch.Tensor, temp, top_k, top_p, min_p, u: torch.Tensor) -> torch.Tensor:
    """Rows where the reference's answer is not within rounding of another: [n] bool."""
    d, keep = ref.sample_filter(x, temp, top_k, top_p, min_p)
    e = d.exp()
    ok = torch.ones(x.shape[0], dtype=torch.bool)
    if min_p is not None:
        ok &= ((e - min_p[:, None]).abs() > 1e-5 * min_p[:, None]).all(-1) | (min_p == 0)
    if top_p is not None:
        before = ref.sample_filter(x, temp, top_k, None, min_p)[1]
        w = torch.where(before, e, 0).double()
        above = torch.stack([(w[i] * (d[i][None, :] > d[i][:, None])).sum(-1) for i in range(x.shape[0])])  # [n, V]
        total = w.sum(-1, keepdim=True)
        gap = torch.where(before, (above - top_p.double()[:, None] * total).abs() / total, 1.0)
        ok &= (gap > 1e-5).all(-1) | (top_p >= 1)
    w = torch.where(keep, e, 0).double()
    cum = w.cumsum(-1)
    total = cum[:, -1:]
    ok &= ((cum - u[:, None] * total).abs() / total > 1e-6).all(-1)
    return ok


def _kept_by(x, temp, min_p, cuts):
    d, _ = ref.sample_filter(x, temp, None, None, None)
    kept = (d > float("-inf")) & (d >= cuts[:, None])
    return kept & (d.exp() >= min_p[:, None]) if min_p is not None else kept


@pytest.mark.parametrize("size", range(len(DRAWS)), ids=DRAW_IDS)
@pytest.mark.parametrize("ties", [False, True])
def test_the_kernel_draws_the_references_token_from_the_references_set(size, ties):
    V, n = 301, 8
    draw, sizes = DRAWS[size]
    x = _rows(n, V, seed=size + 10 * ties, ties=ties)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
    rows = torch.arange(n)
    checked = 0
    for which in OPTIONS:
        temp, top_k, top_p, min_p = _options(n, V, which, seed=size)
        cuts = torch.empty(n)
        got = draw(x, rows, temp, top_k, top_p, min_p, u, cuts=cuts, **sizes)
        want = ref.sample_draw(x, rows, temp, top_k, top_p, min_p, u)
        keep = ref.sample_filter(x, temp, top_k, top_p, min_p)[1]
        decided = _decided(x, temp, top_k, top_p, min_p, u)
        kept = _kept_by(x, temp, min_p, cuts)
        for i in range(n):
            assert keep[i, got[i]], (which, i)  # never a token the reference drops
            if decided[i]:
                assert got[i] == want[i], (which, i)
                assert torch.equal(kept[i], keep[i]), (which, i)
                checked += 1
    assert checked >= 0.9 * n * len(OPTIONS)


@pytest.mark.parametrize("draw, sizes", [DRAWS[0], DRAWS[-3]], ids=["one-program", "wide"])
def test_rows_of_nan_inf_and_nothing(draw, sizes):
    V = 200
    x = _rows(5, V, seed=3, ties=False)
    x[0, 7] = float("nan")  # NaN is never drawn
    x[1, 11] = float("inf")  # the largest float: drawn at any u (its probability is 1)
    x[2] = float("-inf")  # nothing to draw
    x[3, :] = float("-inf")
    x[3, 50] = 0.0  # one token left
    rows = torch.tensor([0, 1, 2, 3, 4])
    temp = torch.full((5,), 0.7)
    top_k, top_p = torch.full((5,), 5), torch.full((5,), 0.9)
    u = torch.tensor([0.3, 0.999, 0.5, 0.5, 0.0], dtype=torch.float64)
    for args in [(None, None, None), (top_k, top_p, torch.full((5,), 0.01))]:
        got = draw(x, rows, temp, *args, u, **sizes)
        assert got.tolist() == ref.sample_draw(x, rows, temp, *args, u).tolist()
        assert got[0] != 7 and got[1] == 11 and got[2] == -1 and got[3] == 50


@pytest.mark.parametrize("draw, sizes", [DRAWS[1], DRAWS[-2]], ids=["one-program", "wide"])
def test_rows_are_picked_by_index(draw, sizes):
    x = _rows(6, 150, seed=4, ties=False)
    rows = torch.tensor([4, 1])
    temp, top_p = torch.tensor([1.0, 0.6]), torch.tensor([0.9, 0.9])
    u = torch.tensor([0.25, 0.75], dtype=torch.float64)
    got = draw(x, rows, temp, None, top_p, None, u, **sizes)
    assert got.tolist() == [ref.sample_draw(x[r:r + 1], torch.tensor([0]), temp[j:j + 1], None, top_p[j:j + 1], None,
                                            u[j:j + 1]).item() for j, r in enumerate(rows.tolist())]


def test_ties_at_the_edges_stay_together():
    # d: 0, -1, -1, -1, -3: top-k 2 keeps the three tied -1 entries; top-p keeps a tie group whole or not at all
    x = torch.tensor([[0.0, -1.0, -1.0, -1.0, -3.0]])
    one = torch.ones(1)
    _, keep = ref.sample_filter(x, one, torch.tensor([2]), None, None)
    assert keep[0].tolist() == [True, True, True, True, False]
    p_top = 1 / (1 + 3 * torch.e ** -1 + torch.e ** -3)  # the top token's probability
    _, keep = ref.sample_filter(x, one, None, torch.tensor([p_top * 0.99]), None)
    assert keep[0].tolist() == [True, False, False, False, False]  # the mass above the tie group is >= top_p
    _, keep = ref.sample_filter(x, one, None, torch.tensor([p_top * 1.01]), None)
    assert keep[0].tolist() == [True, True, True, True, False]
    for args in [(torch.tensor([2]), None), (None, torch.tensor([p_top * 1.01]))]:
        for draw, sizes in (DRAWS[0], DRAWS[-3]):
            cuts = torch.empty(1)
            draw(x, torch.tensor([0]), one, *args, None, torch.tensor([0.5], dtype=torch.float64), cuts=cuts, **sizes)
            assert cuts.item() == -1.0


def test_the_inverse_distribution_follows_the_probabilities():
    """u on an even grid of N points: each token takes a share of them within 1 / N of its probability."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    temp, top_k = torch.tensor([0.9]), torch.tensor([4])
    N = 2000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    got = ref.sample_draw(x.expand(N, -1), torch.arange(N), temp.expand(N), top_k.expand(N), None, None, u)
    d, keep = ref.sample_filter(x, temp, top_k, None, None)
    probs = torch.where(keep, d.exp(), 0)[0]
    probs /= probs.sum()
    share = torch.bincount(got, minlength=6).double() / N
    assert (share - probs).abs().max() <= 1 / N + 1e-9
    kernel = sample_draw_fused(x.expand(64, -1), torch.arange(64), temp.expand(64), top_k.expand(64), None, None,
                               u[::N // 64][:64], **SIZES[0])
    assert torch.equal(kernel, got[::N // 64][:64])
