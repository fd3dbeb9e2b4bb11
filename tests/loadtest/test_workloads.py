"""Workloads: token-exact text with the tiny checkpoint's tokenizer, agentic conversations that
share their prefix, prompt files."""

from __future__ import annotations

import json
import random

import pytest

from engine.tokenizer import Tokenizer
from loadtest.workloads import (
    Length,
    LoadConfig,
    TokenText,
    WorkloadConfig,
    load_prompts,
    make_workload,
    resolve_tokenizer,
)


@pytest.fixture(scope="module")
def text():
    return TokenText(resolve_tokenizer(""))


def test_length_parse_and_draw():
    assert Length.parse("128") == Length(128, 128)
    assert Length.parse(7) == Length(7, 7)
    r = Length.parse("64:256")
    rng = random.Random(0)
    draws = [r.draw(rng) for _ in range(500)]
    assert min(draws) >= 64 and max(draws) <= 256 and len(set(draws)) > 50
    for bad in ("0", "10:5", "x", "-3:4"):
        with pytest.raises(ValueError):
            Length.parse(bad)


@pytest.mark.parametrize("n", [1, 2, 17, 128, 1000])
def test_text_is_token_exact(text, n):
    rng = random.Random(n)
    for _ in range(5):
        s = text.text(n, rng)
        assert len(text.tokenizer.encode(s, add_special_tokens=False)) == n
        # what the server counts: the engine's own tokenizer, begin-of-sentence token included
        assert text.count(s) == len(Tokenizer(resolve_tokenizer("")).encode(s)) == n + 1


def test_random_workload_exact_lengths_and_no_shared_prefix():
    w = make_workload(WorkloadConfig(kind="random", input_len="40:60", output_len="5:9"))
    prompts = []
    for user in range(4):
        session = w.session(user)
        for _ in range(5):
            r = session.next_request()
            assert 41 <= r.prompt_tokens <= 61 and 5 <= r.max_tokens <= 9
            prompts.append(w.text.tokenizer.encode(r.prompt))
    # the first 16-token block differs between any two prompts: no prefix-cache hits by chance
    assert len({tuple(p[:17]) for p in prompts}) == len(prompts)
    # reproducible per (seed, level, user)
    assert w.session(0, 3).next_request().prompt == w.session(0, 3).next_request().prompt
    assert w.session(0, 3).next_request().prompt != w.session(0, 4).next_request().prompt


def test_agentic_turns_grow_one_conversation():
    cfg = WorkloadConfig(kind="agentic", system_len=48, turn_len="16", output_len="8", turns=3)
    w = make_workload(cfg)
    a, b = w.session(0), w.session(1)
    first = a.next_request()
    assert first.turn == 1 and first.prompt.startswith(w.text.tokenizer.bos_token + w.system)
    a.on_reply(first, " some reply")
    second = a.next_request()
    # the whole first exchange is a prefix of the second prompt (what prefix caching reuses)
    prefix = first.prompt + " some reply"
    assert second.prompt.startswith(prefix) and second.turn == 2 and second.session == first.session
    assert second.prompt_tokens > first.prompt_tokens + 16
    other = b.next_request()
    assert other.prompt.startswith(w.text.tokenizer.bos_token + w.system) and other.prompt != first.prompt
    a.on_reply(second, " r2")
    third = a.next_request()
    a.on_reply(third, " r3")
    fresh = a.next_request()  # after `turns` turns a new conversation starts, same system prompt
    assert fresh.turn == 1 and fresh.session != first.session and " r3" not in fresh.prompt
    assert fresh.prompt.startswith(w.text.tokenizer.bos_token + w.system)


def test_agentic_failed_turn_is_not_answered():
    w = make_workload(WorkloadConfig(kind="agentic", system_len=8, turn_len="4", output_len="2", turns=4))
    s = w.session(0)
    r1 = s.next_request()  # no on_reply: it failed
    r2 = s.next_request()
    assert r2.prompt.startswith(r1.prompt.removesuffix("<｜Assistant｜>"))
    assert r2.turn == 2


def test_prompts_file(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Hello there", "max_tokens": 5}) + "\n\n"
                     + json.dumps({"text": "Second"}) + "\n")
    assert load_prompts(str(jsonl)) == [("Hello there", 5), ("Second", None)]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert load_prompts(str(txt)) == [("one", None), ("two", None)]
    w = make_workload(WorkloadConfig(kind="prompts", prompts_file=str(jsonl), output_len="3"))
    s = w.session(0)
    got = [s.next_request() for _ in range(3)]
    assert {(r.prompt, r.max_tokens) for r in got} == {("Hello there", 5), ("Second", 3)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_prompts(str(bad))
    with pytest.raises(ValueError, match="prompts-file"):
        load_prompts("")


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown workload settings"):
        WorkloadConfig.from_dict({"kind": "random", "inputlen": 3})
    cfg = LoadConfig(temperature=0.5, ignore_eos=False)
    assert cfg.sampling(make_workload(WorkloadConfig()).session(0).next_request()) == {
        "max_tokens": 64, "temperature": 0.5}
