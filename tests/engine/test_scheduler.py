"""The step policy: decodes first, then prefill chunks, then waiting prompts, within
max_num_batched_tokens; long_prefill_token_threshold caps one sequence's chunk."""

from engine.cache import KVCache
from engine.models.deepseek_v4.config import load_config
from engine.request import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _scheduler(tiny_dir, budget, threshold=0):
    cfg = load_config(tiny_dir)
    cache = KVCache(cfg, 16, 200, 200, 8, dtype=__import__("torch").float32)
    return Scheduler(cache, cfg.sliding_window, 8, budget, long_prefill_token_threshold=threshold)


def _seq(name, n):
    return Sequence(name, list(range(5, 5 + n)), SamplingParams(max_tokens=50))


def _run(sched, steps=1):
    for _ in range(steps):
        out = sched.schedule()
        sched.advance(out)
        for seq, _ in out:  # sample one token where the chunk reached the end
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(9)
    return out


def test_decodes_go_before_an_older_sequences_prefill_chunks(tiny_dir):
    sched = _scheduler(tiny_dir, budget=32)
    long, short = _seq("long", 400), _seq("short", 4)
    short.output_token_ids.append(9)
    for seq, done in ((long, 64), (short, 4)):  # long mid-prefill (admitted first), short decoding
        sched.cache.allocate(seq.blocks, 0, done)
        seq.num_computed_tokens = seq.compress_from = done
    sched.running = [long, short]
    # admission order would give long the whole budget and stall short's stream for the step
    assert [(s.request_id, n) for s, n in _run(sched)] == [("short", 1), ("long", 31)]


def test_long_prefill_threshold_caps_one_sequence_and_admits_the_next(tiny_dir):
    sched = _scheduler(tiny_dir, budget=64, threshold=24)
    a, b, c = _seq("a", 100), _seq("b", 100), _seq("c", 10)
    for s in (a, b, c):
        sched.add(s)
    out = _run(sched)
    assert [(s.request_id, n) for s, n in out] == [("a", 24), ("b", 24), ("c", 10)]
    out = _run(sched)
    assert [(s.request_id, n) for s, n in out] == [("c", 1), ("a", 24), ("b", 24)]
    assert sum(n for _, n in out) <= 64


def test_without_threshold_one_prompt_takes_the_whole_budget(tiny_dir):
    sched = _scheduler(tiny_dir, budget=64)
    a, b = _seq("a", 100), _seq("b", 10)
    sched.add(a)
    sched.add(b)
    assert [(s.request_id, n) for s, n in _run(sched)] == [("a", 64)]


def test_the_first_scheduling_time_is_kept(tiny_dir):
    sched = _scheduler(tiny_dir, budget=64)
    a, b = _seq("a", 100), _seq("b", 10)
    sched.add(a)
    sched.add(b)
    _run(sched)
    assert a.scheduled_time is not None and b.scheduled_time is None  # b still waits: the budget went to a
    first = a.scheduled_time
    _run(sched, steps=2)  # a's second chunk and decode, b admitted
    assert a.scheduled_time == first and b.scheduled_time is not None and b.scheduled_time >= first
