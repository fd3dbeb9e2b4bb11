"""A consumer that falls behind the engine gets the deltas that piled up as one: fewer, larger
deltas, nothing lost, nothing reordered (AsyncLLM.add and the Triton response thread)."""

from __future__ import annotations

import asyncio

from engine.llm import AsyncLLM
from engine.request import GenerationRequest, RequestOutput, SamplingParams, merge_outputs


def test_merge_joins_new_parts_and_keeps_the_last_counters():
    a = RequestOutput("r", text="Hel", token_ids=[1, 2], num_prompt_tokens=5, num_output_tokens=2,
                      cumulative_logprob=-1.0, logprobs=[{1: -0.5}, {2: -0.5}])
    b = RequestOutput("r", text="", token_ids=[3], num_prompt_tokens=5, num_output_tokens=3,
                      cumulative_logprob=-1.5, logprobs=[{3: -0.5}])
    c = RequestOutput("r", text="lo", token_ids=[4], num_prompt_tokens=5, num_output_tokens=4,
                      cumulative_logprob=-2.0, logprobs=[{4: -0.5}], finished=True, finish_reason="length")
    m = merge_outputs([a, b, c])
    assert (m.text, m.token_ids, m.num_output_tokens, m.cumulative_logprob) == ("Hello", [1, 2, 3, 4], 4, -2.0)
    assert m.logprobs == [{1: -0.5}, {2: -0.5}, {3: -0.5}, {4: -0.5}]
    assert m.finished and m.finish_reason == "length" and m.num_prompt_tokens == 5
    assert merge_outputs([a]) is a
    assert merge_outputs([RequestOutput("r", text="x"), RequestOutput("r", text="y")]).logprobs is None


def test_a_slow_consumer_gets_fewer_deltas_with_the_same_content():
    sampling = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)

    async def collect(engine: AsyncLLM, rid: str, pause_s: float) -> list[RequestOutput]:
        outs = []
        async for out in engine.add(GenerationRequest(rid, prompt="The slow reader", sampling=sampling)):
            outs.append(out)
            await asyncio.sleep(pause_s)  # meanwhile the engine steps on and its deltas queue up
        return outs

    async def main():
        async with AsyncLLM({"max_model_len": 256, "dtype": "float32"}) as engine:
            return await collect(engine, "fast", 0), await collect(engine, "slow", 0.05)

    fast, slow = asyncio.run(main())
    assert len(slow) < len(fast) and any(len(o.token_ids) > 1 for o in slow)
    for part in ("text", "token_ids", "logprobs"):
        joined = [getattr(o, part) for o in fast], [getattr(o, part) for o in slow]
        assert [x for xs in joined[0] for x in xs] == [x for xs in joined[1] for x in xs], part
    assert sum(len(o.token_ids) for o in slow) == slow[-1].num_output_tokens == 48
    assert slow[-1].finished and slow[-1].finish_reason == "length"
    assert slow[-1].cumulative_logprob == fast[-1].cumulative_logprob
