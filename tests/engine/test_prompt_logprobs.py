"""prompt_logprobs against a plain reference: transformers' full forward of the tiny model with
log_softmax in float32, while the engine scores the prompt chunk by chunk (chunked prefill, the LM
head in slices); batched with requests that do not ask for them (theirs unchanged), across a
preemption, with prefix caching on (no cache read: every position), and bad values refused."""

import pytest
import torch

import engine.prompt_logprobs as PL
from engine.llm import LLM
from engine.request import GenerationRequest, InvalidRequest, SamplingParams
from tests.engine.conftest import reference_model

K = 4
TOL = 1e-4
PROMPT_LEN = 45  # three 16-token chunks


def prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def ids(llm):
    return prompt(llm.engine.cfg.vocab_size)


@pytest.fixture(scope="module")
def want(tiny_dir, ids):
    """The reference's log_softmax in float32 at every position [len(ids), vocab]."""
    with torch.no_grad():
        logits = reference_model(tiny_dir, torch.float32)(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **kw)


def check_against_reference(c, ids, want, k=K):
    """c: an offline Completion or a RequestOutput (both carry vLLM's two lists)."""
    assert len(c.prompt_logprobs) == len(ids) == len(c.prompt_logprob_ranks)
    assert c.prompt_logprobs[0] is None and c.prompt_logprob_ranks[0] is None
    for p in range(1, len(ids)):
        entry, lp = c.prompt_logprobs[p], want[p - 1]
        token = ids[p]
        assert next(iter(entry)) == token, "the prompt token comes first"
        assert abs(entry[token] - lp[token].item()) <= TOL, p
        top_v, top_i = lp.topk(k)
        assert set(entry) == {token, *top_i.tolist()}, p
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert abs(entry[t] - v) <= TOL, (p, t)
        # vLLM's rank: tokens at least as likely (bracketed by the tolerance, for near ties)
        rank = c.prompt_logprob_ranks[p]
        assert int((lp >= lp[token] + TOL).sum()) <= rank <= int((lp >= lp[token] - TOL).sum()), p


def test_chunked_prefill_matches_the_full_forward(llm, ids, want, monkeypatch):
    # 3 rows per LM-head slice: every chunk is scored in several slices
    monkeypatch.setattr(PL, "SLICE_BYTES", 3 * 4 * llm.engine.cfg.vocab_size)
    c = llm.generate([ids], greedy(prompt_logprobs=K))[0]
    check_against_reference(c, ids, want)
    assert c.token_ids == llm.generate([ids], greedy())[0].token_ids, "prompt_logprobs change no output"
    zero = llm.generate([ids], greedy(prompt_logprobs=0))[0]
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[t] for t in ids[1:]]  # the prompt token only
    assert zero.prompt_logprob_ranks == c.prompt_logprob_ranks


def test_batched_with_requests_that_do_not_use_it(llm, ids, want):
    vocab = llm.engine.cfg.vocab_size
    others = [prompt(vocab, 30, seed=5), prompt(vocab, 7, seed=6), prompt(vocab, 20, seed=8)]
    mates = [greedy(), SamplingParams(max_tokens=4, temperature=0.8, seed=2, ignore_eos=True), greedy(logprobs=2)]
    alone = [llm.generate([p], [m])[0] for p, m in zip(others, mates)]
    short = prompt(vocab, 9, seed=9)
    batch = llm.generate([ids, *others, short], [greedy(prompt_logprobs=K), *mates, greedy(prompt_logprobs=1)])
    check_against_reference(batch[0], ids, want)
    for got, ref in zip(batch[1:4], alone):  # a batch's float32 sums differ in the last bits, not its tokens
        assert got.token_ids == ref.token_ids and got.prompt_logprobs is None
        assert all(abs(a[t] - b[t]) <= TOL for a, b in zip(got.logprobs or [], ref.logprobs or []) for t in a)
    # the same batch without prompt_logprobs: every output bit-identical
    plain = llm.generate([ids, *others, short], [greedy(), *mates, greedy()])
    assert [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in plain] == \
        [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in batch]
    solo = llm.generate([short], greedy(prompt_logprobs=1))[0]
    assert batch[4].prompt_logprob_ranks == solo.prompt_logprob_ranks
    for a, b in zip(batch[4].prompt_logprobs[1:], solo.prompt_logprobs[1:]):
        assert list(a) == list(b) and all(abs(a[t] - b[t]) <= TOL for t in a)


def test_a_preempted_prompt_is_scored_once(llm, ids, want):
    eng = llm.engine
    eng.add_request(GenerationRequest("pre", prompt_token_ids=ids, sampling=greedy(prompt_logprobs=K)))
    outs = eng.step()  # the first chunk
    seq = eng.requests["pre"].seq
    assert seq.prompt_logprobs_next == 17 and not outs  # rows 0..15 score tokens 1..16
    eng.scheduler.running.remove(seq)  # preempted as the scheduler does when blocks run out: recomputed
    eng.scheduler._preempt(seq)
    while eng.has_unfinished():
        outs += eng.step()
    first = next(o for o in outs if o.prompt_logprobs is not None)
    assert sum(o.prompt_logprobs is not None for o in outs) == 1 and first.token_ids
    check_against_reference(first, ids, want)


def test_prefix_cache_is_not_read_for_them(tiny_dir, ids, want):
    llm = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=True)
    llm.generate([ids], greedy())  # fills the cache with the prompt's blocks
    hits = llm.engine.stats()["prefix_cache_hits"]
    seq = llm.engine.add_request(GenerationRequest("p", prompt_token_ids=ids, sampling=greedy(prompt_logprobs=K)))
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert seq.num_cached_tokens == 0 and llm.engine.stats()["prefix_cache_hits"] == hits
    first = next(o for o in outs if o.prompt_logprobs is not None)
    check_against_reference(first, ids, want)
    llm.generate([ids], greedy())
    assert llm.engine.stats()["prefix_cache_hits"] == hits + 1, "the others still hit"


@pytest.mark.parametrize("value", [-1, 21])
def test_bad_values_are_refused_naming_the_key(llm, value):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        llm.engine.add_request(GenerationRequest(f"bad{value}", prompt="hi", sampling=greedy(prompt_logprobs=value)))


def test_slices_give_the_same_scores(llm):
    model, V = llm.engine.model, llm.engine.cfg.vocab_size
    hidden = torch.randn(11, model.cfg.hc_mult, model.cfg.hidden_size)  # rows of last residual streams
    targets = torch.randint(0, V, (11,))
    whole = PL.score(model.compute_logits, hidden, targets, 3, V)
    sliced = PL.score(model.compute_logits, hidden, targets, 3, V, slice_bytes=2 * 4 * V)
    assert whole.ranks == sliced.ranks and whole.top_ids == sliced.top_ids and len(whole.top_ids[0]) == 3
    close = lambda a, b: torch.allclose(torch.tensor(a), torch.tensor(b), atol=TOL, rtol=0)
    assert close(whole.logprobs, sliced.logprobs) and close(whole.top_logprobs, sliced.top_logprobs)
    lp = model.compute_logits(hidden).log_softmax(-1)
    assert close(whole.logprobs, lp.gather(1, targets[:, None])[:, 0].tolist())
