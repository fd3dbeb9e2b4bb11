"""vLLM's sampling keys on the tiny model: every step's token against a plain torch reference
applied to that step's raw logits, and the same tokens when batched with requests that do not
use the key; float32-edge values that once failed a step; a request whose sampling fails
alone fails alone (no step failure, nothing recomputed)."""

import asyncio
import logging

import pytest

from engine.llm import LLM, AsyncLLM
from engine.request import GenerationRequest, RequestFailed, SamplingParams
from tests.engine.test_sampler import ref_kept, ref_process

PROMPT = "The quick brown fox"
OTHERS = ["Hello there", "Once upon a time", "1 2 3 4"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32")


def run_alone(llm, sp: SamplingParams):
    """Step one request alone; its tokens and each step's raw logits (what the sampler got)."""
    eng = llm.engine
    seq = eng.add_request(GenerationRequest("alone", prompt=PROMPT, sampling=sp))
    steps = []
    while eng.has_unfinished():
        eng.last_logits = {}
        eng.step()
        if "alone" in eng.last_logits:
            steps.append(eng.last_logits["alone"].clone())
    return seq, steps


def greedy(**kw):
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **kw)


def key_cases(llm):
    base = llm.generate([PROMPT], greedy())[0].token_ids
    word = llm.tokenizer.decode([base[3]])
    return {
        "presence_penalty": greedy(presence_penalty=1.5),
        "frequency_penalty": greedy(frequency_penalty=2.0),
        "repetition_penalty": greedy(repetition_penalty=1.8),
        "logit_bias": greedy(logit_bias={str(base[1]): -100.0, "7": 3.0}),
        "bad_words": greedy(bad_words=[word]),
        "allowed_token_ids": greedy(allowed_token_ids=sorted({base[4], base[6], 11, 12, 300})),
        "min_p": SamplingParams(max_tokens=10, temperature=1.0, min_p=0.2, seed=3, ignore_eos=True),
    }, base


@pytest.mark.parametrize("key", ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                                 "bad_words", "allowed_token_ids", "min_p"])
def test_key_matches_the_reference_alone_and_batched(llm, key):
    cases, base = key_cases(llm)
    sp = cases[key]
    seq, steps = run_alone(llm, sp)
    tokens = list(seq.output_token_ids)
    assert len(tokens) == len(steps) == 10
    for t, raw in enumerate(steps):
        x = ref_process(raw, sp, seq.prompt_token_ids, tokens[:t], [])
        if sp.greedy:
            assert tokens[t] == int(x.argmax()), (key, t)
        else:
            assert tokens[t] in ref_kept(x, sp), (key, t)
    if sp.greedy:
        assert tokens != base, f"{key} should change this greedy output"
    mates = [greedy(), SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True), greedy(logprobs=2)]
    batch = llm.generate([PROMPT, *OTHERS], [sp, *mates])
    assert batch[0].token_ids == tokens
    alone = [llm.generate([p], [m])[0].token_ids for p, m in zip(OTHERS, mates)]
    assert [c.token_ids for c in batch[1:]] == alone


def test_tiny_temperature_and_top_p_are_greedy_and_fail_no_step(llm):
    base = llm.generate([PROMPT], greedy())[0].token_ids
    before = llm.engine.scheduler.num_preemptions
    out = llm.generate([PROMPT, PROMPT, PROMPT, "Hello"],
                       [SamplingParams(max_tokens=10, temperature=1e-40, ignore_eos=True),
                        SamplingParams(max_tokens=10, temperature=3e-6, seed=1, ignore_eos=True),
                        SamplingParams(max_tokens=10, temperature=0.8, top_p=1e-300, seed=2, ignore_eos=True),
                        SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)])
    assert [o.token_ids for o in out[:3]] == [base] * 3  # a top_p that small keeps the top token only
    assert all(o.finish_reason == "length" for o in out)
    assert llm.engine.scheduler.num_preemptions == before


def test_a_request_whose_sampling_fails_fails_alone_and_nothing_is_recomputed(tiny_dir, caplog):
    async def run():
        async with AsyncLLM({"model": str(tiny_dir), "dtype": "float32"}) as engine:
            eos = engine.engine.tokenizer.eos_token_id or engine.engine.cfg.eos_token_ids[0]

            async def collect(rid, prompt, sp):
                tokens = []
                async for out in engine.add(GenerationRequest(rid, prompt=prompt, sampling=sp)):
                    tokens += out.token_ids
                return tokens

            good = [collect(f"good-{i}", p, greedy()) for i, p in enumerate(OTHERS)]
            # min_tokens bans EOS, allowed_token_ids allows EOS only: nothing is left to sample
            bad = collect("bad", PROMPT, SamplingParams(max_tokens=10, temperature=0, min_tokens=3, allowed_token_ids=[eos]))
            results = await asyncio.gather(*good, bad, return_exceptions=True)
            return results, engine.stats()

    with caplog.at_level(logging.ERROR, logger="deepseek.engine"):
        results, stats = asyncio.run(run())
    *good, bad = results
    assert isinstance(bad, RequestFailed) and "every token is masked" in str(bad)
    llm = LLM(str(tiny_dir), dtype="float32")
    assert good == [llm.generate([p], greedy())[0].token_ids for p in OTHERS]
    assert stats["num_preemptions"] == 0 and stats["num_step_failures"] == 0 and stats["num_requests_failed"] == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "bad" in errors[0].getMessage() and errors[0].exc_info is None


def test_logprob_ranks_are_vllms_count_over_the_vocabulary(llm):
    eng = llm.engine
    sp = SamplingParams(max_tokens=8, temperature=1.5, seed=11, logprobs=1, ignore_eos=True)
    eng.add_request(GenerationRequest("ranked", prompt=PROMPT, sampling=sp))
    raws, outs = [], []
    while eng.has_unfinished():
        eng.last_logits = {}
        outs += eng.step()
        if "ranked" in eng.last_logits:
            raws.append(eng.last_logits["ranked"].float())
    tokens = [t for o in outs for t in o.token_ids]
    ranks = [r for o in outs for r in o.logprob_ranks]
    expected = [int((raw.log_softmax(-1) >= raw.log_softmax(-1)[t]).sum()) for raw, t in zip(raws, tokens)]
    assert ranks == expected and len(ranks) == 8
    assert max(ranks) > 2, "the test needs a sampled token outside the top-n"


def test_the_warm_up_compiles_every_set_of_draw_options(llm, monkeypatch):
    """A GPU engine's warm-up runs K.sample_draw once for each set of options a sampled batch may use (its kernels are
    compiled per set), on the model's vocabulary; here the reference runs the same calls."""
    import kernels

    seen = []
    real = kernels.sample_draw

    def record(logits, rows, temperature, top_k, top_p, min_p, u):
        seen.append((logits.shape[-1], top_k is not None, top_p is not None, min_p is not None))
        return real(logits, rows, temperature, top_k, top_p, min_p, u)

    monkeypatch.setattr(kernels, "sample_draw", record)
    llm.engine._warm_draw()
    V = llm.engine.cfg.vocab_size
    assert sorted(seen) == sorted((V, k, p, m) for k in (False, True) for p in (False, True) for m in (False, True))
