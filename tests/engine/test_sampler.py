"""The batched sampler against plain per-row torch references written from vLLM's definitions:
penalties, logit_bias, bad words, allowed_token_ids, min_p / top-k / top-p, logprob ranks, and
values at float32's edges (tiny temperature / top_p / repetition_penalty) that once made a
step raise."""

import random

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import (
    SamplingRow,
    filter_logits,
    in_flight_logprobs,
    pick_on_device,
    process_logits,
    sample,
    seeded_uniform,
)
from engine.sequence import PENDING_TOKEN

V = 97  # awkward on purpose


def ref_process(x: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], banned: list[int]):
    """vLLM's logits processors for one row, written out token by token."""
    x = x.clone().float()
    if p.allowed_token_ids is not None:
        keep = torch.full_like(x, float("-inf"))
        keep[p.allowed_token_ids] = x[p.allowed_token_ids]
        x = keep
    for word in p.bad_words_token_ids or []:
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]:
            x[word[-1]] = float("-inf")
    for t in banned:
        x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[int(t)] += min(100.0, max(-100.0, b))
    for t in set(prompt) | set(output):
        if x[t] > 0:
            x[t] = x[t] / p.repetition_penalty
        else:
            x[t] = x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def ref_kept(x: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a sampled row may draw: temperature, min_p, top-k, top-p (mass strictly above < top_p)."""
    x = x / p.temperature
    probs = x.softmax(-1)
    kept = {t for t in range(len(x)) if probs[t] >= p.min_p * probs.max() and x[t] > float("-inf")}
    if 0 < p.top_k < len(x):
        kth = sorted((x[t].item() for t in kept), reverse=True)[min(p.top_k, len(kept)) - 1]
        kept = {t for t in kept if x[t] >= kth}
    z = torch.tensor([x[t] if t in kept else float("-inf") for t in range(len(x))])
    probs = z.softmax(-1)
    order = sorted(kept, key=lambda t: -probs[t].item())
    out, above = set(), 0.0
    for t in order:
        if not out or above < p.top_p:
            out.add(t)
        above += probs[t].item()
    return out


def random_params(rng: random.Random, greedy: bool) -> SamplingParams:
    p = SamplingParams(temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.7]), logprobs=rng.choice([None, 0, 3]))
    keys = rng.sample(["presence", "frequency", "repetition", "bias", "bad", "allowed", "none"], 2)
    if "presence" in keys:
        p.presence_penalty = rng.uniform(-2, 2)
    if "frequency" in keys:
        p.frequency_penalty = rng.uniform(-2, 2)
    if "repetition" in keys:
        p.repetition_penalty = rng.choice([0.5, 1.3, 2.0])
    if "bias" in keys:
        p.logit_bias = {str(rng.randrange(V)): rng.uniform(-150, 150) for _ in range(3)}
    if "bad" in keys:
        p.bad_words_token_ids = [[rng.randrange(V)], [rng.randrange(V), rng.randrange(V)]]
    if "allowed" in keys:
        p.allowed_token_ids = rng.sample(range(V), 7)
    if not greedy:
        p.top_k, p.top_p, p.min_p = rng.choice([0, 5, 40]), rng.choice([1.0, 0.9, 0.5]), rng.choice([0.0, 0.1])
    return p


def random_rows(rng: random.Random, n: int, greedy: bool) -> list[SamplingRow]:
    rows = []
    for i in range(n):
        output = [rng.randrange(V) for _ in range(rng.randrange(6))]
        p = random_params(rng, greedy)
        if p.bad_words_token_ids and output:  # make a two-token bad word's prefix match sometimes
            p.bad_words_token_ids[1][0] = output[-1]
        p.seed = 1000 + i
        rows.append(SamplingRow(p, len(output), [rng.randrange(V) for _ in range(5)], output,
                                rng.sample(range(V), rng.choice([0, 2]))))
    return rows


@pytest.mark.parametrize("trial", range(6))
def test_greedy_with_every_processor_matches_the_reference_alone_and_batched(trial):
    rng = random.Random(trial)
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(trial)) * 4
    rows = random_rows(rng, 9, greedy=True)
    batched = sample(logits, rows)
    processed = process_logits(logits.clone(), rows)
    for i, (row, s) in enumerate(zip(rows, batched)):
        ref = ref_process(logits[i], row.params, row.prompt_ids, row.output_ids, row.banned)
        assert torch.allclose(processed[i], ref, atol=1e-5), (i, row)
        assert s.error is None and s.token_id == int(ref.argmax()), (i, row)
        assert s.logprob == pytest.approx(float(logits[i].log_softmax(-1)[s.token_id]), abs=1e-5)  # raw, as vLLM
        assert sample(logits[i:i + 1], [row])[0] == s  # the same alone


@pytest.mark.parametrize("trial", range(6))
def test_sampled_rows_draw_only_what_the_reference_keeps_and_seeds_ignore_batch_mates(trial):
    rng = random.Random(100 + trial)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(trial)) * 3
    rows = random_rows(rng, 8, greedy=False)
    for step in range(5):
        for row in rows:
            row.step = step
        batched = sample(logits, rows, torch.Generator().manual_seed(step))
        for i, (row, s) in enumerate(zip(rows, batched)):
            x = ref_process(logits[i], row.params, row.prompt_ids, row.output_ids, row.banned)
            assert s.token_id in ref_kept(x, row.params), (i, row)
            assert sample(logits[i:i + 1], [row])[0].token_id == s.token_id  # seeded: batch mates do not matter


def test_filter_logits_keeps_the_reference_sets():
    rng = random.Random(5)
    for trial in range(40):
        x = torch.randn(V, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.5, 3, 10])
        p = SamplingParams(temperature=rng.choice([0.3, 1.0, 2.0]), top_k=rng.choice([0, 1, 3, 50]),
                           top_p=rng.choice([1.0, 0.95, 0.6, 0.1]), min_p=rng.choice([0.0, 0.05, 0.5]))
        kept = filter_logits(x[None], torch.tensor([p.temperature]), torch.tensor([p.top_k or V]),
                             torch.tensor([p.top_p]), torch.tensor([p.min_p]))[0]
        assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == ref_kept(x, p), (trial, p)


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits[0].softmax(-1)
    counts = torch.zeros(4)
    for seed in range(4000):
        counts[sample(logits, [SamplingRow(SamplingParams(temperature=1.0, seed=seed), 0, [0], [], [])])[0].token_id] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03), (counts / 4000, probs)


def test_logprob_ranks_count_every_token_at_least_as_likely():
    logits = torch.tensor([[3.0, 1.0, 1.0, 2.0, -1.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=2, logit_bias={"4": 10.0}), 0, [0], [], [])
    s = sample(logits, [row])[0]
    assert s.token_id == 4 and s.rank == 5  # chosen by its bias; ranked on the raw logprobs, as vLLM
    assert list(s.top_logprobs) == [0, 3, 4]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40),  # below float32's smallest normal: the logits overflowed
    SamplingParams(temperature=1e-6, seed=1),
    SamplingParams(temperature=1e-5, seed=2),
    SamplingParams(temperature=0.8, top_p=1e-300, seed=3),  # 0 in float32: every token was dropped
    SamplingParams(temperature=0.8, top_p=1e-45, min_p=1.0, seed=4),
    SamplingParams(temperature=0.0, repetition_penalty=1e-300),
    SamplingParams(temperature=1e-5, repetition_penalty=1e-30, seed=5),
    SamplingParams(temperature=1e30, seed=6),
])
def test_extreme_values_sample_a_valid_token(params):
    logits = torch.tensor([[30.0, 5.0, -3.0, 29.0, 0.0]] * 2)
    rows = [SamplingRow(params, 0, [1], [], []), SamplingRow(SamplingParams(temperature=0), 0, [1], [], [])]
    s, plain = sample(logits, rows)
    assert s.error is None and 0 <= s.token_id < 5 and plain.token_id == 0
    if params.temperature < 1e-5 or params.top_p < 1e-30:
        assert s.token_id == (0 if params.repetition_penalty == 1 else 1)  # the top token (1: prompt token favoured)


def test_a_row_with_nothing_left_fails_alone():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[2, 4] = float("nan")
    rows = [SamplingRow(SamplingParams(temperature=0), 0, [1], [], []),
            SamplingRow(SamplingParams(temperature=0.7, allowed_token_ids=[5, 6], seed=1), 0, [1], [], [5, 6]),
            SamplingRow(SamplingParams(temperature=0), 0, [1], [], [])]
    ok, masked, nan = sample(logits, rows)
    assert ok.error is None and ok.token_id == int(logits[0].argmax())
    assert "every token is masked" in masked.error and "NaN" in nan.error


@pytest.mark.parametrize("seeded", [True, False])
def test_the_device_pick_is_the_samplers_pick_for_rows_with_nothing_to_process(seeded):
    """What a step kept in flight picks (engine/sampler.pick_on_device: no host read) against `sample` on the same
    rows and generator state: the same tokens and raw logprobs for greedy and drawn rows (temperature, top-k, top-p,
    min_p; seeded at their step or from the shared generator), and NaN where `sample` fails a row (NaN logits; every
    token -inf)."""
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(3)) * 2
    logits[5, 9] = float("nan")
    logits[6] = float("-inf")
    kinds = (dict(temperature=0), dict(temperature=0.8), dict(temperature=1.0, top_k=5),
             dict(temperature=0.6, top_p=0.8), dict(temperature=1.3, min_p=0.1), dict(temperature=0.9),
             dict(temperature=0.9))
    params = [SamplingParams(**k, seed=40 + i if seeded else None) for i, k in enumerate(kinds)]
    steps = [3, 0, 7, 1, 2, 4, 5]
    for trial in range(4):
        want = sample(logits, [SamplingRow(p, s, [1], [], []) for p, s in zip(params, steps)],
                      torch.Generator().manual_seed(trial))
        got = pick_on_device(logits, [SamplingRow(p, s, [1], [], []) for p, s in zip(params, steps)],
                             torch.Generator().manual_seed(trial))
        assert got.shape == (3, 7) and got.dtype == torch.float64
        assert [w.error is not None for w in want] == [False] * 5 + [True] * 2
        for i, w in enumerate(want):
            if w.error is not None:
                assert torch.isnan(got[2, i]), i
                continue
            assert int(got[0, i]) == w.token_id and abs(float(got[1, i]) - w.logprob) < 1e-6, (trial, i)
            assert torch.isfinite(got[2, i])
    greedy = pick_on_device(logits[:1], [SamplingRow(params[0], steps[0], [1], [], [])])  # greedy only: the fused argmax
    assert int(greedy[0, 0]) == int(logits[0].argmax())


@pytest.mark.parametrize("seeded", [True, False])
def test_the_device_pick_applies_bias_allowed_ids_and_bans(seeded):
    """Processing that needs no token generated so far (logit_bias, allowed_token_ids, min_tokens' stop ids) is
    applied on the device too: `sample`'s tokens and raw logprobs, greedy and drawn, and NaN where every token is
    masked; processing by history (penalties, bad words) is refused."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4)) * 2
    top = logits.argmax(-1).tolist()
    kinds = (dict(temperature=0, logit_bias={str((top[0] + 1) % V): 50.0}), dict(temperature=0),
             dict(temperature=0.8, allowed_token_ids=[3, 5, top[2]]), dict(temperature=0.9, top_k=4),
             dict(temperature=0, allowed_token_ids=[top[4]]), dict(temperature=1.1, logit_bias={"7": -100.0}))
    bans = [[], [top[1], 2], [], [top[3]], [top[4]], []]  # row 4: its one allowed token banned: nothing to pick
    params = [SamplingParams(**k, seed=60 + i if seeded else None) for i, k in enumerate(kinds)]
    steps = [1, 0, 4, 2, 0, 3]
    for trial in range(3):
        want = sample(logits, [SamplingRow(p, s, [1], [], b) for p, s, b in zip(params, steps, bans)],
                      torch.Generator().manual_seed(trial))
        got = pick_on_device(logits, [SamplingRow(p, s, [1], [], b) for p, s, b in zip(params, steps, bans)],
                             torch.Generator().manual_seed(trial))
        assert [w.error is not None for w in want] == [False] * 4 + [True, False]
        for i, w in enumerate(want):
            if w.error is not None:
                assert torch.isnan(got[2, i]), i
                continue
            assert int(got[0, i]) == w.token_id and abs(float(got[1, i]) - w.logprob) < 1e-6, (trial, i)
    assert int(got[0, 0]) == (top[0] + 1) % V and int(got[0, 1]) != top[1] and int(got[0, 2]) in (3, 5, top[2])
    with pytest.raises(ValueError, match="tokens so far"):
        pick_on_device(logits[:1], [SamplingRow(SamplingParams(temperature=0, bad_words_token_ids=[[3, 4]]), 0, [1],
                                                [], [])])
    one_token = SamplingRow(SamplingParams(temperature=0, bad_words_token_ids=[[top[0]]]), 0, [1], [PENDING_TOKEN], [])
    assert int(pick_on_device(logits[:1], [one_token])[0, 0]) == sample(logits[:1], [one_token])[0].token_id != top[0]


@pytest.mark.parametrize("seeded", [True, False])
def test_the_device_pick_counts_the_pending_token_in_the_penalties(seeded):
    """A step kept in flight picks the next token before the previous one is on the host (its output ids hold
    PENDING_TOKEN, its value is on the device): the penalties count it from there, as `sample` counts it once it is
    read back."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8)) * 2
    top = logits.argmax(-1).tolist()
    kinds = (dict(temperature=0, presence_penalty=50.0), dict(temperature=0, frequency_penalty=20.0),
             dict(temperature=0.3, repetition_penalty=1e4), dict(temperature=0, repetition_penalty=2.0))
    params = [SamplingParams(**k, seed=80 + i if seeded else None) for i, k in enumerate(kinds)]
    prompts, outputs = [[1, 2], [3], [4], [top[3]]], [[], [7], [5], []]
    pending = [top[0], top[1], top[2], -1]  # each pending token its row's most likely; row 3: nothing pending
    held = [o + ([PENDING_TOKEN] if t >= 0 else []) for o, t in zip(outputs, pending)]
    known = [o + ([t] if t >= 0 else []) for o, t in zip(outputs, pending)]
    for trial in range(3):
        want = sample(logits, [SamplingRow(p, len(o), q, o, []) for p, q, o in zip(params, prompts, known)],
                      torch.Generator().manual_seed(trial))
        got = pick_on_device(logits, [SamplingRow(p, len(o), q, o, []) for p, q, o in zip(params, prompts, held)],
                             torch.Generator().manual_seed(trial), torch.tensor(pending))
        assert [int(t) for t in got[0]] == [w.token_id for w in want], trial
    assert all(int(got[0, i]) != top[i] for i in range(3))  # the pending top token penalized away


@pytest.mark.parametrize("greedy_only", [True, False])
def test_the_device_pick_carries_the_samplers_logprobs_and_ranks(greedy_only):
    """Rows that ask for logprobs (0, 1, 4 of them) beside rows that ask for none: the rows pick_on_device adds,
    read back as a step in flight reads them, give `sample`'s top logprobs and ranks."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9)) * 2
    asks = (None, 0, 1, 4, None)
    temps = (0, 0, 0, 0, 0) if greedy_only else (0, 0.9, 0, 1.1, 0.7)
    params = [SamplingParams(temperature=t, logprobs=m, seed=7 + i) for i, (t, m) in enumerate(zip(temps, asks))]
    steps = [2, 0, 5, 1, 3]
    want = sample(logits, [SamplingRow(p, s, [1], [], []) for p, s in zip(params, steps)])
    host = pick_on_device(logits, [SamplingRow(p, s, [1], [], []) for p, s in zip(params, steps)]).tolist()
    assert len(host) == 3 + 1 + 2 * 4
    for i, (w, m) in enumerate(zip(want, asks)):
        assert int(host[0][i]) == w.token_id
        if m is None:
            assert w.top_logprobs is None
            continue
        top, rank = in_flight_logprobs(host, i, w.token_id, host[1][i], m)
        assert rank == w.rank and list(top) == list(w.top_logprobs), i
        assert all(abs(top[t] - w.top_logprobs[t]) < 1e-5 for t in top), i


def test_seeded_uniforms_depend_on_seed_and_step_alone():
    """A seeded request's draw at token i: a uniform hashed from (seed, i), spread evenly over [0, 1)."""
    u = torch.tensor([seeded_uniform(seed, step) for seed in range(100) for step in range(100)], dtype=torch.float64)
    assert u.min() >= 0 and u.max() < 1 and len(set(u.tolist())) == len(u)
    assert abs(u.mean().item() - 0.5) < 0.01 and torch.histc(u, bins=10, min=0, max=1).min() > 900
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(7, 4)


def test_the_kernels_draw_is_the_references():
    """The engine's draw through the fused kernels (K.sample_draw: kernels/fused_draw_wide.py, under the interpreter)
    picks the reference backend's tokens for every sampling option, seeded rows and rows drawn from the generator."""
    import kernels

    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(8)) * 2
    kinds = (dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=0.6, top_p=0.8),
             dict(temperature=1.3, min_p=0.1), dict(temperature=0.9, top_k=20, top_p=0.7, min_p=0.02),
             dict(temperature=0.7, top_p=0.5))
    rows = [SamplingRow(SamplingParams(**k, seed=7 + i if i % 2 else None), i, [1], [], []) for i, k in
            enumerate(kinds)]
    picked = {}
    try:
        for backend in ("ref", "fused"):
            kernels.set_backend(backend)
            picked[backend] = [[s.token_id for s in sample(logits, rows, torch.Generator().manual_seed(trial))]
                               for trial in (0,)]
        assert kernels.sample_draw.__module__ == "kernels.fused_draw_wide"
    finally:
        kernels.set_backend("auto")
    assert picked["fused"] == picked["ref"]
