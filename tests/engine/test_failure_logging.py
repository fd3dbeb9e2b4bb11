"""A request that fails logs one line each, never a traceback (a client can trigger failures at
will: a 2.5 KB traceback per request floods the log)."""

import asyncio
import logging

from engine.llm import AsyncLLM
from engine.request import GenerationRequest, RequestFailed, SamplingParams


def test_a_failing_step_logs_one_line_per_failure_without_a_traceback(tiny_dir, caplog):
    async def run():
        async with AsyncLLM({"model": str(tiny_dir), "dtype": "float32", "fault_injection_marker": "@@FAULT@@"}) as engine:
            async def collect(prompt):
                return [out async for out in engine.add(GenerationRequest(
                    prompt, prompt=prompt, sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))]
            return await asyncio.gather(collect("fine"), collect("bad @@FAULT@@"), return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="deepseek.engine"):
        fine, bad = asyncio.run(run())
    assert isinstance(bad, RequestFailed) and not isinstance(fine, BaseException)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(r.exc_info is None and "\n" not in r.getMessage() for r in errors), \
        [(r.getMessage(), r.exc_info is not None) for r in errors]
