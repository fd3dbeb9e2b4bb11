"""Async scheduling (a step whose tokens are picked on the device, greedy or drawn, stays in flight while the next
one is scheduled and launched; its tokens are read back one call later) changes nothing a user sees: the same
tokens, texts, logprobs and finish reasons as the synchronous engine, through chunked
prefill, preemption, stop conditions found one step late, seeded sampling, prefix caching
and aborts. On the CPU it runs the same code path (the copy back is simply synchronous)."""

import pytest
import torch

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams


def _prompts(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (L,), generator=g).tolist() for L in lengths]


def _both(tiny_dir, prompts, params, **args):
    """Sync, async with every step overlapped, async reading back before eager steps (CUDA's policy)."""
    runs = []
    for on, flush_first in ((False, False), (True, False), (True, True)):
        llm = LLM(str(tiny_dir), dtype="float64", max_model_len=256, async_scheduling=on, **args)
        llm.engine.flush_before_eager = flush_first
        out = llm.generate(prompts, params)
        c = llm.engine.cache
        assert c.window_pool.num_free == c.window_pool.num_blocks and c.full_pool.num_free == c.full_pool.num_blocks
        assert llm.engine.pending is None
        runs.append(out)
    return runs


def _same(sync, async_):
    """Same tokens, text and finish reason; logprobs equal to float rounding (a sequence that
    finishes frees its blocks one step later, so preemption can batch the recompute differently)."""
    assert [(o.token_ids, o.text, o.finish_reason) for o in async_] == [(o.token_ids, o.text, o.finish_reason)
                                                                       for o in sync]
    for a, b in zip(async_, sync):
        assert abs(a.cumulative_logprob - b.cumulative_logprob) <= 1e-5 * max(1.0, abs(b.cumulative_logprob))
        assert (a.logprobs is None) == (b.logprobs is None)
        for la, lb in zip(a.logprobs or [], b.logprobs or []):
            assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) <= 1e-5 for k in la)


def test_greedy_batches_with_chunking_and_preemption_are_unchanged(tiny_dir):
    prompts = _prompts(20, 4000)
    params = [SamplingParams(max_tokens=4 + 3 * (i % 7), temperature=0, ignore_eos=True) for i in range(20)]
    sync, *asyncs = _both(tiny_dir, prompts, params, max_num_batched_tokens=48, max_num_seqs=32,
                          num_gpu_blocks_override=30)
    for async_ in asyncs:
        _same(sync, async_)


def test_stops_found_one_step_late_and_mixed_sampling_are_unchanged(tiny_dir):
    prompts = _prompts(12, 4000, seed=1)
    probe = LLM(str(tiny_dir), dtype="float64", max_model_len=256).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    params = []
    for i, ref in enumerate(probe):
        kind = i % 6
        if kind == 0:  # a stop token that the greedy stream reaches mid-way
            params.append(SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ref.token_ids[7]]))
        elif kind == 1:  # a stop string taken from its own text
            text = ref.text
            params.append(SamplingParams(max_tokens=20, temperature=0, stop=[text[len(text) // 2:][:3]] if len(text) > 6
                                         else []))
        elif kind == 2:  # seeded sampling: its steps stay in flight too, drawn on the device
            params.append(SamplingParams(max_tokens=12, temperature=0.8, seed=i))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=9, temperature=0, logprobs=3))
        elif kind == 4:
            params.append(SamplingParams(max_tokens=9, min_tokens=5, temperature=0))
        else:
            params.append(SamplingParams(max_tokens=1, temperature=0))
    sync, *asyncs = _both(tiny_dir, prompts, params, max_num_batched_tokens=64)
    for async_ in asyncs:
        _same(sync, async_)


def test_prefix_caching_with_replay_is_unchanged(tiny_dir):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(5, 4000, (70,), generator=g).tolist()
    prompts = [system + torch.randint(5, 4000, (n,), generator=g).tolist() for n in (5, 20, 33, 9)]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    sync, *asyncs = _both(tiny_dir, prompts + prompts, [params] * 8, enable_prefix_caching=True)
    for async_ in asyncs:
        _same(sync, async_)


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, ignore_eos=True),
                                SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True),
                                SamplingParams(max_tokens=30, temperature=0.7, logit_bias={"9": 3.0},
                                               allowed_token_ids=list(range(5, 400)), min_tokens=20,
                                               bad_words_token_ids=[[9], [10]]),
                                SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                                               repetition_penalty=1.2, ignore_eos=True)],
                         ids=["greedy", "sampled", "logprobs", "bias_allowed_min_tokens", "penalties"])
def test_steps_really_stay_in_flight_and_aborts_return_every_block(tiny_dir, sp):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 256, "async_scheduling": True})
    for i in range(3):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=[9 + i] * (10 + 7 * i), sampling=sp))
    in_flight = 0
    for _ in range(6):
        eng.step()
        in_flight += eng.pending is not None
    assert in_flight >= 4
    out = eng.abort("r1")
    assert out.finished and -1 not in eng.requests["r0"].seq.output_token_ids[:-1]
    while eng.has_unfinished():
        for o in eng.step():
            assert -1 not in o.token_ids
    c = eng.cache
    assert c.window_pool.num_free == c.window_pool.num_blocks and c.full_pool.num_free == c.full_pool.num_blocks


def test_a_mixed_step_with_a_partial_prefill_chunk_stays_in_flight(tiny_dir):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 256, "async_scheduling": True,
                     "max_num_batched_tokens": 24})
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng.add_request(GenerationRequest("short", prompt_token_ids=list(range(5, 15)), sampling=sp))
    eng.step()  # short's prompt: it samples
    eng.add_request(GenerationRequest("long", prompt_token_ids=list(range(5, 105)), sampling=sp))
    eng.step()  # short's decode + the first 23 of long's 100 prompt tokens
    assert eng.pending is not None and [s.request_id for s, _ in eng.pending.scheduled] == ["short"]
    long = next(s for s in eng.scheduler.running if s.request_id == "long")
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens and not long.has_pending_token


def test_sampled_batches_are_unchanged_for_seeded_requests(tiny_dir):
    """Every sampling option that keeps a step in flight (temperature, top-k, top-p, min_p; greedy rows beside them;
    logprobs asked for or not; logit_bias, allowed ids, min_tokens, one-token bad words; penalties, which count the
    token still in flight on the device), through chunked prefill: a seeded request draws
    each token at its own (seed, step) uniform, so it gives the synchronous engine's tokens though its previous token
    is still pending when the next is drawn."""
    prompts = _prompts(15, 4000, seed=3)
    kinds = (dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.2, min_p=0.05), dict(temperature=0), dict(temperature=0.9, logit_bias={"11": 4.0}),
             dict(temperature=0, allowed_token_ids=list(range(100, 160))),
             dict(temperature=0.6, min_tokens=10, ignore_eos=False),
             dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
             dict(temperature=0.9, repetition_penalty=1.8, frequency_penalty=0.4),
             dict(temperature=0.8, bad_words_token_ids=[[13], [14]]))
    params = [SamplingParams(**{"max_tokens": 14, "ignore_eos": True, "seed": 100 + i, "logprobs": (None, 2, 0)[i % 3],
                                **kinds[i % len(kinds)]}) for i in range(15)]
    sync, *asyncs = _both(tiny_dir, prompts, params, max_num_batched_tokens=64)
    for async_ in asyncs:
        _same(sync, async_)
