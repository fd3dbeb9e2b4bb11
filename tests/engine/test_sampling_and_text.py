"""Sampler options, stop strings, finish reasons, logprobs, UTF-8-safe incremental detokenization."""

import math
import random

import pytest
import torch

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, InvalidRequest, SamplingParams
from engine.sampler import SamplingRow, filter_logits, sample
from engine.tokenizer import Detokenizer, Tokenizer


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32")


@pytest.mark.parametrize("byte_table", [True, False])  # False: the path of tokenizers that are not byte-level
def test_detokenizer_never_emits_half_a_character(tiny_dir, byte_table):
    tok = Tokenizer(tiny_dir)
    if not byte_table:
        tok.token_bytes = None
    text = "a 龘 b 🙂 c ﷺ d"  # rare characters: byte-level BPE splits them over several tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    detok = Detokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_byte_level_detokenizer_equals_a_full_decode(tiny_dir):
    """Random runs of lone bytes (continuation and lead bytes: invalid UTF-8 on purpose), longer
    tokens and added tokens, both special-token settings: the streamed text is tokenizers' own
    decode of the whole run, replacement characters included."""
    tok = Tokenizer(tiny_dir)
    assert tok.token_bytes is not None, "the tiny tokenizer is byte-level"
    lone = [i for i, b in enumerate(tok.token_bytes) if len(b) == 1 and b[0] >= 0x80]
    longer = [i for i, b in enumerate(tok.token_bytes) if len(b) > 1]
    assert lone and longer and tok.added
    end = tok.encode("a", add_special_tokens=False)  # settles a trailing incomplete character
    rng = random.Random(0)
    for _ in range(500):
        pools = rng.choices([lone, longer, list(tok.added)], weights=[6, 3, 1], k=rng.randint(1, 12))
        ids = [rng.choice(pool) for pool in pools] + end
        for skip in (True, False):
            detok = Detokenizer(tok, skip_special_tokens=skip)
            assert "".join(detok.push(i) for i in ids) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_stop_string_cuts_exactly_and_streams_no_part_of_it(llm):
    base = llm.generate(["Once upon"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop.strip()) >= 2
    eng = llm.engine
    eng.add_request(GenerationRequest("s", prompt="Once upon",
                                      sampling=SamplingParams(max_tokens=40, temperature=0, stop=[stop])))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    streamed = "".join(d.text for d in deltas)
    assert streamed == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)


def test_finish_reasons_and_token_counts(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    first = out.token_ids[2]
    stopped = llm.generate(["x"], SamplingParams(max_tokens=7, temperature=0, stop_token_ids=[first]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[: out.token_ids.index(first) + 1]
    held = llm.generate(["x"], SamplingParams(max_tokens=7, min_tokens=5, temperature=0, stop_token_ids=[first]))[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


def test_logprobs_top_n_and_cumulative(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
    assert math.isclose(out.cumulative_logprob, sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-5)


def test_filters_keep_what_they_should():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])

    def kept(p):
        args = (torch.tensor([p.temperature]), torch.tensor([p.top_k or 5]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
        return torch.isfinite(filter_logits(logits[None], *args)[0]).tolist()

    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [True, True, False, False, False]
    probs = logits.softmax(-1)  # 0.64, 0.24, 0.09, ...
    assert kept(SamplingParams(temperature=1.0, top_p=0.8)) == [True, True, False, False, False] and probs[0] < 0.8
    assert kept(SamplingParams(temperature=1.0, min_p=0.3)) == [True, True, False, False, False]
    draws = {sample(logits[None], [SamplingRow(SamplingParams(temperature=1.0, top_k=2, seed=s), 0, [0], [], [])])[0].token_id
             for s in range(40)}
    assert draws == {0, 1}


@pytest.mark.parametrize("sp, message", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=10**7), "max_tokens"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(min_p=2), "min_p"),
    (SamplingParams(logprobs=1000), "logprobs"),
    (SamplingParams(stop=["x" * 1000]), "stop"),
])
def test_bad_sampling_parameters_are_refused(tiny_dir, sp, message):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32"})
    with pytest.raises(InvalidRequest, match=message):
        eng.add_request(GenerationRequest("bad", prompt="hi", sampling=sp))
    with pytest.raises(InvalidRequest, match="max_model_len"):
        eng.add_request(GenerationRequest("long", prompt_token_ids=[5] * eng.max_model_len))
    with pytest.raises(InvalidRequest, match="empty"):
        eng.add_request(GenerationRequest("empty", prompt=""))


def test_every_front_takes_engine_arguments_the_same_way(tiny_dir):
    """EngineArgs or a mapping of vLLM's names, for LLMEngine, AsyncLLM, CoreClient and LLM
    (which also takes vLLM's LLM(model, **engine_args))."""
    from engine.args import EngineArgs
    from engine.core_client import CoreClient
    from engine.llm import LLM, AsyncLLM

    args = EngineArgs.from_dict({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 128})
    as_dict = {"model": str(tiny_dir), "dtype": "float32", "max_model_len": 128}
    assert EngineArgs.of(args) is args and EngineArgs.of(as_dict) == args
    assert AsyncLLM(args).args == AsyncLLM(as_dict).args == CoreClient(as_dict).args == args
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    texts = {LLM(str(tiny_dir), dtype="float32", max_model_len=128).generate(["Hi"], greedy)[0].text,
             LLM(args).generate(["Hi"], greedy)[0].text, LLM(as_dict).generate(["Hi"], greedy)[0].text}
    assert len(texts) == 1
