"""engine/spec/rejection_sampler.py: emitted tokens are distributed as the target's, whatever the drafts.

Chi-square goodness of fit at p-value 1e-4 (a correct sampler fails about once in 10,000 seeds;
the seeds here are fixed, so the outcome is deterministic), on enough draws that the wrong rules
a sampler could follow are caught: accepting every draft, resampling from p instead of
p - q after a rejection, or reading the wrong position's distribution.
"""

import torch

from engine.spec.rejection_sampler import greedy_accept, rejection_sample

P_VALUE = 1e-4


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against the expected distribution (cells with mass only)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    n = counts.sum()
    exp = probs[keep].double() * n
    stat = ((counts[keep].double() - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _draw(p, drafts, n, seed):
    S = n
    probs = p[None].expand(S, -1, -1)
    d = torch.tensor(drafts)[None].expand(S, -1)
    num = torch.full((S,), len(drafts))
    return rejection_sample(probs, d, num, torch.Generator().manual_seed(seed))


def test_each_emitted_token_follows_the_target_distribution():
    V = 6
    g = torch.Generator().manual_seed(0)
    p = torch.rand(3, V, generator=g) ** 2
    p[1, 4] = 0  # a token the target never emits at position 1
    p = p / p.sum(-1, keepdim=True)
    drafts = [2, 4]  # the second draft has target probability 0: always rejected there
    tokens, accepted = _draw(p, drafts, 40_000, seed=1)
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi_square_p(first, p[0]) > P_VALUE
    second = tokens[accepted >= 1, 1]  # position 1 given the first draft was accepted
    assert chi_square_p(torch.bincount(second, minlength=V), p[1]) > P_VALUE
    assert (accepted <= 1).all()
    assert 0.5 * p[0, 2] < (accepted >= 1).float().mean() < 1.5 * p[0, 2]


def test_bonus_token_after_all_accepted_follows_the_last_position():
    V = 5
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    tokens, accepted = _draw(p, [2], 20_000, seed=2)
    assert (accepted == 1).all() and (tokens[:, 0] == 2).all()
    assert chi_square_p(torch.bincount(tokens[:, 1], minlength=V), p[1]) > P_VALUE


def test_the_test_catches_wrong_samplers():
    """The bound is tight enough: an always-accept or a resample-from-p sampler fails it."""
    V = 6
    p = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    n = 40_000
    always_accept = torch.bincount(torch.full((n,), 1), minlength=V)
    assert chi_square_p(always_accept, p) < P_VALUE
    # resampling from p (not p - q) after rejecting draft 1 over-represents token 1
    g = torch.Generator().manual_seed(3)
    acc = torch.rand(n, generator=g) < p[1]
    resampled = torch.multinomial(p, n, replacement=True, generator=g)
    wrong = torch.where(acc, torch.tensor(1), resampled)
    assert chi_square_p(torch.bincount(wrong, minlength=V), p) < P_VALUE
    tokens, _ = _draw(p[None].repeat(2, 1), [1], n, seed=4)
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V), p) > P_VALUE


def test_greedy_accepts_the_matching_prefix_then_the_argmax():
    target = torch.tensor([[5, 7, 9, 11], [5, 7, 9, 11], [5, 7, 9, 11]])
    drafts = torch.tensor([[5, 7, 9], [5, 8, 9], [4, 7, 9]])
    tokens, acc = greedy_accept(target, drafts, torch.tensor([3, 3, 2]))
    assert acc.tolist() == [3, 1, 0]
    assert tokens.tolist() == [[5, 7, 9, 11], [5, 7, -1, -1], [5, -1, -1, -1]]
    tokens, acc = greedy_accept(target[:1], drafts[:1], torch.tensor([1]))
    assert acc.tolist() == [1] and tokens.tolist() == [[5, 7, -1, -1]]
