"""AsyncLLM's failure handling in-process (no server): step-fault isolation by recompute, fatal
errors, admission, and cancellation at every stage, each ending with every block free."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.llm import AsyncLLM
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    RequestFailed,
    SamplingParams,
)

pytestmark = pytest.mark.slow

MARKER = "INJECT-FAULT-7f3a"
ARGS = {"max_model_len": 256, "dtype": "float32", "fault_injection_marker": MARKER}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _collect(engine: AsyncLLM, rid: str, prompt: str, sampling: SamplingParams):
    """(text, finish_reason) or the exception."""
    try:
        outs = [o async for o in engine.add(GenerationRequest(rid, prompt=prompt, sampling=sampling))]
        return "".join(o.text for o in outs), outs[-1].finish_reason
    except Exception as e:  # noqa: BLE001 - the result under test
        return e


def _pool_full(engine: AsyncLLM) -> bool:
    blocks = engine.stats()["kv_blocks"]
    return all(b["free"] == b["total"] for b in blocks.values())


async def _until(predicate, timeout_s: float = 30.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("async_scheduling", [False, True])  # True: steps in flight when the fault hits
def test_step_faults_fail_only_the_faulty_requests(async_scheduling):
    async def main():
        async with AsyncLLM({**ARGS, "async_scheduling": async_scheduling}) as engine:
            prompts = [f"innocent request number {i}" for i in range(4)]
            alone = [await _collect(engine, f"alone-{i}", p, _greedy(32)) for i, p in enumerate(prompts)]
            innocents = [asyncio.create_task(_collect(engine, f"good-{i}", p, _greedy(32)))
                         for i, p in enumerate(prompts)]
            await _until(lambda: engine.stats()["running"] == 4 and engine.stats()["generation_tokens"] > 4 * 32 + 8)
            # two faulty requests in one batch with four innocents mid-decode
            faulty = [asyncio.create_task(_collect(engine, f"bad-{i}", f"x {MARKER} {i}", _greedy(8)))
                      for i in range(2)]
            results = await asyncio.gather(*innocents, *faulty)
            assert results[:4] == alone  # recomputed from their tokens: the same greedy text
            for bad in results[4:]:
                assert isinstance(bad, RequestFailed) and "InjectedFault" in str(bad)
            stats = engine.stats()
            assert stats["num_step_failures"] >= 1 and stats["num_requests_failed"] == 2
            assert stats["running"] == 0 and stats["waiting"] == 0 and _pool_full(engine)
            assert engine.health()
            assert (await _collect(engine, "after", "still alive", _greedy(4)))[1] == "length"

    asyncio.run(main())


def test_a_fatal_error_fails_everything_in_flight_and_refuses_the_rest():
    async def main():
        async with AsyncLLM(ARGS) as engine:
            innocent = asyncio.create_task(_collect(engine, "good", "a long innocent request", _greedy(200)))
            await _until(lambda: engine.stats()["running"] == 1)
            fatal = await _collect(engine, "fatal", f"{MARKER}:fatal", _greedy(4))
            assert isinstance(fatal, EngineDead) and "InjectedFatalFault" in str(fatal)
            assert isinstance(await asyncio.wait_for(innocent, 10), EngineDead)
            assert not engine.health()
            late = await asyncio.wait_for(_collect(engine, "late", "anyone?", _greedy(4)), 5)
            assert isinstance(late, EngineDead)

    asyncio.run(main())


def test_a_hung_step_is_declared_dead_and_nothing_waits_forever():
    async def main():
        engine = AsyncLLM({**ARGS, "step_timeout_s": 1.0})
        await engine.start()
        try:
            innocent = asyncio.create_task(_collect(engine, "good", "a long innocent request", _greedy(200)))
            await _until(lambda: engine.stats()["running"] == 1)
            start = time.monotonic()
            hung = await asyncio.wait_for(_collect(engine, "hung", f"{MARKER}:hang", _greedy(4)), 30)
            assert isinstance(hung, EngineDead) and "step_timeout_s" in str(hung), hung
            assert isinstance(await asyncio.wait_for(innocent, 5), EngineDead)
            assert time.monotonic() - start < 10  # the timeout (1 s) plus the watchdog's tick, not forever
            assert not engine.health()
            late = await asyncio.wait_for(_collect(engine, "late", "anyone?", _greedy(4)), 5)
            assert isinstance(late, EngineDead)
        finally:
            engine._hang_release.set()  # the blocked step returns, and the step thread closes
            await engine.shutdown()

    asyncio.run(main())


def test_admission_refuses_the_excess_at_once_and_recovers():
    async def main():
        async with AsyncLLM({**ARGS, "max_num_seqs": 2, "max_waiting_requests": 2}) as engine:
            tasks = [asyncio.create_task(_collect(engine, f"r{i}", f"burst {i}", _greedy(16))) for i in range(12)]
            results = await asyncio.gather(*tasks)
            refused = [r for r in results if isinstance(r, EngineOverloaded)]
            done = [r for r in results if isinstance(r, tuple)]
            assert len(refused) + len(done) == 12 and refused and len(done) >= 2
            assert all(r[1] == "length" for r in done)
            assert engine.stats()["num_requests_rejected"] == len(refused)
            assert (await _collect(engine, "after", "calm again", _greedy(4)))[1] == "length"
            assert _pool_full(engine)

    asyncio.run(main())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cancelling_while_queued_in_prefill_and_in_decode_frees_every_block(async_scheduling):
    async def main():
        # one running sequence at a time, 16-token prefill chunks: a long prompt prefills over steps
        engine = AsyncLLM({**ARGS, "max_num_seqs": 1, "max_num_batched_tokens": 16,
                           "async_scheduling": async_scheduling})
        await engine.start()
        try:
            long_prompt = " ".join(["word"] * 180)
            decode = asyncio.create_task(_collect(engine, "decode", "short", _greedy(200)))
            await _until(lambda: engine.stats()["generation_tokens"] >= 3)
            queued = asyncio.create_task(_collect(engine, "queued", "waits its turn", _greedy(200)))
            await _until(lambda: engine.stats()["waiting"] == 1)
            queued.cancel()  # the consumer goes away while the request is queued
            decode.cancel()  # ... and while it decodes
            prefill = asyncio.create_task(_collect(engine, "prefill", long_prompt, _greedy(200)))
            seq = None

            def in_prefill():
                nonlocal seq
                running = engine.engine.scheduler.running
                seq = running[0] if running and running[0].request_id == "prefill" else None
                return seq is not None and 16 <= seq.num_computed_tokens < seq.num_prompt_tokens

            await _until(in_prefill)
            await engine.abort("prefill")  # the Triton side's abort (client cancelled)
            result = await prefill
            assert isinstance(result, tuple) and result[1] == "abort"
            for task in (queued, decode):
                with pytest.raises(asyncio.CancelledError):
                    await task
            await _until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0)
            assert _pool_full(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_engine_that_cannot_run_any_forward_is_declared_dead():
    async def main():
        async with AsyncLLM(ARGS) as engine:
            def broken(*args, **kwargs):
                raise RuntimeError("every forward fails, though not in a way classed as fatal")

            engine.engine.runner.run = broken
            first = await _collect(engine, "first", "hello", _greedy(4))
            assert isinstance(first, RequestFailed)  # failed alone: the culprit, as far as it can tell
            await _until(lambda: not engine.health())  # ... then a one-token probe fails too: dead
            assert isinstance(await _collect(engine, "second", "hello", _greedy(4)), EngineDead)

    asyncio.run(main())
