"""The engine core in its own process behind CoreClient streams what the in-process AsyncLLM
streams, token for token: greedy, seeded sampling, logprobs, stop strings (matched in the front,
which aborts the core's request and drops what it made past the stop), EOS, min_tokens,
invalid requests, aborts; and a slow consumer still gets merged deltas. `submit` (the Triton
model's way in) hands the core client's deltas to the caller's sink on the reader thread, with no
event loop between, and runs an in-process engine's `add` on the caller's loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.core_client import CoreClient
from engine.interface import pump
from engine.llm import AsyncLLM
from engine.request import (
    EngineDead,
    GenerationRequest,
    InvalidRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)

ARGS = {"max_model_len": 256, "dtype": "float32", "enable_prefix_caching": False}

CASES = [
    ("greedy", "The capital of France is", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    ("seeded", "Once upon a time", SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, logprobs=3)),
    ("seeded-2", "Once upon a time", SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=5)),
    ("min-tokens", "Hello", SamplingParams(max_tokens=12, min_tokens=6, temperature=0.7, seed=2)),
    ("bad", "", SamplingParams(max_tokens=4)),
    # the core compiles a grammar off its step loop and admits the request once it is done
    ("json", "A person:", SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": {
        "type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}})),
    ("choice", "Yes or no?", SamplingParams(max_tokens=8, temperature=0.8, seed=3,
                                             structured_outputs={"choice": ["yes", "no", "maybe"]})),
    ("bad-schema", "Hello", SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "no-such-type"}})),
]


def _stop_case(text: str) -> SamplingParams:
    """A stop string that the greedy text reaches mid-way: its last 2 characters around token 8."""
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[text[-2:], "never-there"])


async def _collect(engine, rid: str, prompt: str, sampling: SamplingParams, pause_s: float = 0.0):
    try:
        outs = []
        async for out in engine.add(GenerationRequest(rid, prompt=prompt, sampling=sampling)):
            outs.append(out)
            await asyncio.sleep(pause_s)
        return outs
    except InvalidRequest as e:
        return f"InvalidRequest: {e}"


def _joined(outs):
    """A stream as content: every part joined, the last delta's counters (merging may differ).
    Logprobs as floats: the two runs batch their requests by arrival, which moves float32 sums."""
    if isinstance(outs, str):
        return outs
    last = outs[-1]
    logprobs = [lp for o in outs for lp in o.logprobs or ()]
    return ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
            [sorted(lp) for lp in logprobs], last.finish_reason, last.num_output_tokens, last.num_prompt_tokens,
            sum(o.finished for o in outs),
            [last.cumulative_logprob, *(v for lp in logprobs for _, v in sorted(lp.items()))])


def _expected(outs):
    joined = _joined(outs)
    return joined if isinstance(joined, str) else (*joined[:-1], pytest.approx(joined[-1], rel=1e-5))


async def _run_all(engine, cases):
    async with engine:
        return await asyncio.gather(*[_collect(engine, rid, prompt, sp) for rid, prompt, sp in cases])


@pytest.fixture(scope="module")
def streams():
    """Every case through both engines, concurrently (one batch), plus a stop-string case built
    from the greedy text."""
    first = asyncio.run(_run_all(AsyncLLM(ARGS), CASES[:1]))[0]
    greedy_8 = "".join(o.text for o in first[:8])
    cases = [*CASES, ("stop", CASES[0][1], _stop_case(greedy_8))]
    return cases, asyncio.run(_run_all(AsyncLLM(ARGS), cases)), asyncio.run(_run_all(CoreClient(ARGS), cases))


def test_streams_equal_the_in_process_engine(streams):
    cases, local, remote = streams
    for (rid, _, _), a, b in zip(cases, local, remote):
        assert _joined(b) == _expected(a), rid
    by_id = {rid: out for (rid, _, _), out in zip(cases, remote)}
    assert by_id["bad"].startswith("InvalidRequest: the prompt is empty")
    assert by_id["bad-schema"].startswith("InvalidRequest: structured_outputs.json cannot be compiled")
    assert '"age"' in _joined(by_id["json"])[0] and _joined(by_id["choice"])[0] in ("yes", "no", "maybe")


def test_a_stop_string_ends_the_request_where_the_in_process_engine_does(streams):
    cases, local, remote = streams
    stop = _joined(remote[-1])
    assert stop[3] == "stop" and stop[4] < 24 and not stop[0].endswith(cases[-1][2].stop[0])
    assert len(stop[1]) == stop[4]  # the tokens the core made past the stop are not streamed


def test_abort_ends_the_stream_and_a_slow_consumer_gets_merged_deltas():
    async def main():
        async with CoreClient(ARGS) as engine:
            sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            outs = []
            async for out in engine.add(GenerationRequest("long", prompt="abort me", sampling=sp)):
                outs.append(out)
                if len(outs) == 3:
                    await engine.abort("long")
            fast = await _collect(engine, "fast", "The slow reader", SamplingParams(max_tokens=24, temperature=0))
            slow = await _collect(engine, "slow", "The slow reader", SamplingParams(max_tokens=24, temperature=0),
                                  pause_s=0.25)
            while engine.stats()["running"]:  # stats follow the core's steps
                await asyncio.sleep(0.05)
            return outs, fast, slow, engine.stats()

    outs, fast, slow, stats = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and outs[-1].num_output_tokens < 200
    assert len(slow) < len(fast) and any(len(o.token_ids) > 1 for o in slow)
    assert _joined(slow) == _expected(fast)
    assert stats["running"] == 0 and stats["num_steps"] > 0


class _Sink:
    """Records what `submit` delivers, and on which thread."""

    def __init__(self):
        self.outputs, self.threads, self.errors = [], set(), []
        self.done = threading.Event()

    def output(self, out):
        self.outputs.append(out)
        self.threads.add(threading.current_thread().name)
        if out.finished:
            self.done.set()

    def failed(self, error):
        self.errors.append(error)
        self.threads.add(threading.current_thread().name)
        self.done.set()


def test_submit_hands_each_steps_delta_to_the_sink_on_the_reader_thread_with_the_event_loop_stuck():
    """The Triton model's way in and out: the caller only queues the request (the admission thread
    tokenizes and sends it), no event loop between the core's step and the sink, no
    waiting to gather steps. The client's loop is held still for the whole request; every token
    still arrives, one delta per step, as `add` streams them."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = CoreClient(ARGS)
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)
    try:
        on_loop(engine.start())
        encoded_on = []  # the threads that tokenized: never the caller's (Triton's execute thread)
        encode = engine.tokenizer.encode
        engine.tokenizer.encode = lambda text, **kw: encoded_on.append(threading.current_thread().name) or \
            encode(text, **kw)
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        stuck = threading.Event()
        loop.call_soon_threadsafe(stuck.wait, 120)
        sink, refused = _Sink(), _Sink()
        engine.submit(GenerationRequest("direct", prompt="The capital of France is", sampling=sp), sink, loop)
        engine.submit(GenerationRequest("empty", prompt="", sampling=sp), refused, loop)
        delivered = sink.done.wait(120)
        stuck.set()
        broken = _Sink()
        broken.output = lambda out: 1 / 0  # a bug in the caller's sink fails its request, not the reader
        engine.submit(GenerationRequest("broken", prompt="Hello", sampling=sp), broken, loop)
        broken.done.wait(120)
        streamed = on_loop(_collect(engine, "through-add", "The capital of France is", sp))
    finally:
        on_loop(engine.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert delivered and not sink.errors and sink.threads == {"dsv4-core-supervisor"}
    # "direct" and "broken" ("empty" is refused before it; "through-add" on the loop)
    assert encoded_on.count("dsv4-admission") == 2 and threading.main_thread().name not in encoded_on
    assert refused.threads == {"dsv4-admission"}
    late = _Sink()  # after the shutdown: refused at once, not left in a queue nobody reads
    engine.submit(GenerationRequest("late", prompt="Hello", sampling=sp), late, loop)
    assert late.done.is_set() and [type(e) for e in late.errors] == [EngineDead]
    assert [len(o.token_ids) for o in sink.outputs] == [1] * 12  # each step's token on its own
    assert _joined(sink.outputs)[:-1] == _joined(streamed)[:-1]
    assert refused.done.is_set() and [type(e) for e in refused.errors] == [InvalidRequest]
    assert [type(e) for e in broken.errors] == [RequestFailed] and "ZeroDivisionError" in str(broken.errors[0])


def test_submit_through_add_runs_the_stream_on_the_callers_loop():
    """The in-process engine (and vLLM's) deliver through `add`: `submit` runs it on the loop it is
    given, each delta to the sink there; a refusal, or a stream that ends unfinished, fails it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="callers-loop", daemon=True)
    thread.start()
    engine = AsyncLLM(ARGS)
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)
    try:
        on_loop(engine.start())
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        sink, refused = _Sink(), _Sink()
        engine.submit(GenerationRequest("through-add", prompt="The capital of France is", sampling=sp), sink, loop)
        engine.submit(GenerationRequest("empty", prompt="", sampling=sp), refused, loop)
        delivered = sink.done.wait(120) and refused.done.wait(120)
        streamed = on_loop(_collect(engine, "again", "The capital of France is", sp))
    finally:
        on_loop(engine.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert delivered and not sink.errors and sink.threads == {"callers-loop"}
    assert _joined(sink.outputs)[:-1] == _joined(streamed)[:-1]
    assert [type(e) for e in refused.errors] == [InvalidRequest]

    async def unfinished():
        yield RequestOutput("cut", text="a", token_ids=[5], num_output_tokens=1)

    cut = _Sink()
    asyncio.run(pump(unfinished(), cut))
    assert len(cut.outputs) == 1 and [type(e) for e in cut.errors] == [RequestFailed]
