"""Speculative decoding (engine/spec/decoder.py): greedy outputs exactly as without it, the
cache rolled back and freed, the config refused clearly when unsupported.

Drafts come three ways: the random MTP layer (acceptance near 0: every step rejects, so the
compressors' rollback runs constantly), forced to the plain run's own tokens (all accepted),
and forced to those tokens with every third one wrong (partial acceptance at every offset).
"""

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams
from tests.engine.test_batching import _full


def _prompts(vocab: int, seed: int = 0, lengths=(3, 17, 30, 47)):
    """Around the window (16), the HCA (16) and CSA (4) blocks of the tiny preset."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (L,), generator=g).tolist() for L in lengths]


def _run(path, prompts, params, forced=None, **kw):
    llm = LLM(str(path), dtype="float64", max_model_len=256, **kw)
    if forced is not None:
        llm.engine.spec.force_drafts({f"offline-{i}": f for i, f in enumerate(forced)})
    out = [o.token_ids for o in llm.generate(prompts, params)]
    assert _full(llm.engine)
    return out, llm.engine


def _corrupt(tokens, vocab):
    return [(t + 1) % vocab if i % 3 == 2 else t for i, t in enumerate(tokens)]


PARAMS = [SamplingParams(max_tokens=22 + 2 * i, temperature=0, ignore_eos=True) for i in range(4)]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    prompts = _prompts(4096)
    return prompts, _run(tiny_dir, prompts, PARAMS)[0]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_equals_plain_decoding_whatever_the_drafts(tiny_dir, plain, k):
    prompts, want = plain
    spec = {"method": "mtp", "num_speculative_tokens": k}
    for forced in (None, [_corrupt(w, 4096) for w in want]) + ((want,) if k == 5 else ()):
        got, eng = _run(tiny_dir, prompts, PARAMS, forced, speculative_config=spec)
        assert got == want, f"forced={forced is not None}"
        st = eng.stats()
        assert st["spec_decode_num_draft_tokens"] > 0
        if forced is want:  # every draft agrees: k + 1 tokens per verify (fewer drafts near max_tokens)
            assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
            assert st["spec_decode_mean_acceptance_length"] > 1 + 0.8 * k


def test_greedy_equals_plain_with_chunked_prefill_and_preemption(checkpoints):
    path = checkpoints["narrow-window"]  # window 8, CSA 4 and HCA 32, block_size 32
    prompts = _prompts(4096, seed=1, lengths=(9, 40, 23, 61, 5))
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for _ in prompts]
    kw = dict(max_num_batched_tokens=24, max_num_seqs=5, num_gpu_blocks_override=8)
    want, _ = _run(path, prompts, params, **kw)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    got, eng = _run(path, prompts, params, [_corrupt(w, 4096) for w in want], speculative_config=spec, **kw)
    assert got == want
    assert eng.scheduler.num_preemptions > 0, "the block budget must force preemption mid-speculation"
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0


def _drive(eng, requests, late=None, late_after=3):
    """Run requests (id -> (prompt, params)) to the end, adding `late` after a few steps; their
    tokens, and prompt_logprobs where asked."""
    outs, step = {}, 0
    for rid, (prompt, sp) in requests.items():
        eng.add_request(GenerationRequest(rid, prompt_token_ids=prompt, sampling=sp))
    while eng.has_unfinished() or late:
        if late and step == late_after:
            for rid, (prompt, sp) in late.items():
                eng.add_request(GenerationRequest(rid, prompt_token_ids=prompt, sampling=sp))
            late = None
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.prompt_logprobs is not None:
                outs[o.request_id + "/prompt_logprobs"] = o.prompt_logprobs
        step += 1
    return outs


def test_mixed_speculating_and_fallback_requests_with_async_scheduling(tiny_dir):
    """Seeded greedy requests cannot speculate (k = 0 for them) and may stay in flight (async
    scheduling) when no speculating request shares the step; a speculating request arriving then
    flushes them first (and scores its prompt_logprobs). Every request's tokens equal the plain
    engine's."""
    prompts = _prompts(4096, seed=2, lengths=(12, 33, 20, 7))
    reqs = {"spec-a": (prompts[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
            "seeded-b": (prompts[1], SamplingParams(max_tokens=30, temperature=0, seed=5, ignore_eos=True)),
            "pen-c": (prompts[2], SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5, ignore_eos=True))}
    late = {"spec-d": (prompts[3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2))}
    args = {"model": str(tiny_dir), "dtype": "float64", "max_model_len": 128, "async_scheduling": True}
    want = _drive(LLMEngine(args), reqs, late, late_after=14)
    eng = LLMEngine({**args, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    got = _drive(eng, reqs, late, late_after=14)
    key = "spec-d/prompt_logprobs"
    lp_want, lp_got = want.pop(key), got.pop(key)
    assert got == want
    assert len(lp_got) == len(lp_want) == len(prompts[3]) and lp_got[0] is None
    for a, b in zip(lp_got[1:], lp_want[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-9 for t in a)
    assert eng.stats()["spec_decode_num_drafts"] > 0 and _full(eng)


def test_prefix_cache_hit_with_bounded_replay_under_speculation(tiny_dir):
    """A second request hits the first one's cached blocks (bounded replay rebuilds the window,
    the MTP's too); greedy tokens equal the plain engine's with the same hit."""
    prefix = _prompts(4096, seed=3, lengths=(40,))[0]  # hits 2 blocks of 16 > the window (16)
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        llm = LLM(str(tiny_dir), dtype="float64", max_model_len=256, enable_prefix_caching=True,
                  speculative_config=spec)
        first = llm.generate([prefix + [7, 8, 9]], sp)[0].token_ids
        second = llm.generate([prefix + [10, 11]], sp)[0].token_ids
        st = llm.engine.stats()
        assert st["prefix_cache_hits"] == 1 and st["prefix_cache_replayed_tokens"] > 0
        outs.append((first, second))
        assert _full(llm.engine)  # cached blocks stay reusable but count as free
    assert outs[0] == outs[1]


def test_abort_mid_speculation_frees_everything(tiny_dir):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 128,
                     "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}})
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i in range(3):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=list(range(10 + i, 40)), sampling=sp))
    for _ in range(4):
        eng.step()
    assert any(s.spec_token_ids for s in eng.scheduler.running), "drafts pending when aborted"
    for i in range(3):
        assert eng.abort(f"r{i}").finish_reason == "abort"
    assert not eng.has_unfinished() and _full(eng)


@pytest.mark.parametrize("bad", [{"method": "eagle", "num_speculative_tokens": 1},
                                 {"method": "mtp", "num_speculative_tokens": 17},
                                 {"method": "mtp", "num_speculative_tokens": 0},
                                 {"method": "mtp"}, {"method": "mtp", "num_speculative_tokens": 2, "model": "x"},
                                 "not json", [1]])
def test_unsupported_speculative_config_is_refused_naming_it(tiny_dir, bad):
    with pytest.raises(InvalidEngineArgs, match="speculative_config"):
        LLMEngine({"model": str(tiny_dir), "speculative_config": bad})


def test_speculative_config_with_tensor_parallel_is_refused(tiny_dir):
    with pytest.raises(InvalidEngineArgs, match="speculative_config.*tensor_parallel_size"):
        LLMEngine({"model": str(tiny_dir), "tensor_parallel_size": 2,
                   "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}})


def _exact_joint(path, prompt, sp, V):
    """p(t1, t2, t3) of the plain engine for a top-k sampling request: 1 + k + k^2 prompts."""
    from engine.sampler import sampling_probs

    eng = LLMEngine({"model": str(path), "dtype": "float32", "max_model_len": 64})
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def probs(ids):
        eng.add_request(GenerationRequest("p", prompt_token_ids=ids, sampling=one))
        while eng.has_unfinished():
            eng.step()
        return sampling_probs(eng.last_logits["p"][None].clone(), [sp])[0]

    joint = {}  # (t1, t2, t3) -> probability, over the top-k support
    p1 = probs(prompt)
    for a in p1.nonzero()[:, 0].tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero()[:, 0].tolist():
            p3 = probs(prompt + [a, b])
            for c in p3.nonzero()[:, 0].tolist():
                joint[(a, b, c)] = float(p1[a]) * float(p2[b]) * float(p3[c])
    return joint


def test_sampled_tokens_keep_the_target_distribution(tiny_dir):
    """500 sampled requests (top_k=2, so 8 joint outcomes of the first three tokens; the second and
    third come out of a speculative step) against the plain engine's exact joint distribution. The
    drafts are forced to the prompt's greedy continuation: deterministic drafts, accepted about a
    third of the time, so both the accept and the reject-and-resample paths run. Chi-square at
    p-value 1e-4 with fixed seeds; an always-accepting or wrong-position sampler emits tokens
    outside the top-k support and fails at once."""
    from tests.engine.spec.test_rejection_sampler import P_VALUE, chi_square_p

    V, n = 4096, 500
    prompt = [11, 523, 77, 1200, 9]
    sp = SamplingParams(max_tokens=3, temperature=1.3, top_k=2, ignore_eos=True)
    joint = _exact_joint(tiny_dir, prompt, sp, V)
    assert len(joint) == 8
    cells = list(joint)
    greedy = LLM(str(tiny_dir), dtype="float32", max_model_len=64).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64, max_num_seqs=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    llm.engine.spec.force_drafts({f"offline-{i}": greedy for i in range(n)})
    outs = [tuple(o.token_ids) for o in llm.generate([prompt] * n, sp)]
    st = llm.engine.stats()
    assert st["spec_decode_num_drafts"] >= n  # every request verified drafts at least once
    assert 0.1 < st["spec_decode_acceptance_rate"] < 0.9  # both paths taken
    assert all(o in joint for o in outs), "a token outside the target's top-k was emitted"
    counts = torch.tensor([outs.count(c) for c in cells])
    assert chi_square_p(counts, torch.tensor([joint[c] for c in cells])) > P_VALUE
