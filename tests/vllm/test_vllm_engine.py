"""backend/vllm_engine.py against a real vllm AsyncLLM (CPU, tiny Llama), without Triton:
engine-argument checks, the sampling-parameter mapping, and what the server tests cannot pin
down: abort and disconnect freeing the cache, stop strings, admission limits, prefix-cache stats,
shutdown."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from backend.engine_setup import build_engine
from engine.request import (
    EngineDead,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
)
from tests.vllm import VLLM_CPU_ARGS, needs_vllm

pytestmark = needs_vllm

REPO = Path(__file__).resolve().parents[2]
V4_FLASH_MODEL_JSON = REPO / "model_repository_vllm" / "deepseek_v4" / "1" / "model.json"
ENGINE_ARGS = {**VLLM_CPU_ARGS, "max_model_len": 512, "max_num_seqs": 8, "enable_prefix_caching": True,
               "max_num_queued_reqs": 4}
PROMPT = "The quick brown fox"


# ------------------------------------------------------------------ engine arguments (nothing starts)


def test_unknown_arguments_name_the_key_and_the_likely_one(vllm_checkpoint):
    from backend.vllm_engine import InvalidVllmArgs

    with pytest.raises(InvalidVllmArgs, match=r"'enable_prefix_cache' \(did you mean 'enable_prefix_caching'\?\)"):
        build_engine({**ENGINE_ARGS, "model": str(vllm_checkpoint), "enable_prefix_cache": True})
    with pytest.raises(InvalidVllmArgs, match=r"'kernels' is a native-engine argument \(vLLM has none\)"):
        build_engine({**ENGINE_ARGS, "model": str(vllm_checkpoint), "kernels": "ref"})


def test_a_bad_nested_value_is_refused_before_anything_loads(vllm_checkpoint):
    from backend.vllm_engine import InvalidVllmArgs

    with pytest.raises(InvalidVllmArgs, match="vLLM rejected the engine arguments"):
        build_engine({**ENGINE_ARGS, "model": str(vllm_checkpoint),
                      "compilation_config": {"cudagraph_mode": "SOMETIMES"}})


def test_the_native_tiny_deepseek_checkpoint_is_refused_with_the_reason(tmp_path):
    from backend.vllm_engine import InvalidVllmArgs

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "head_dim": 32}))
    with pytest.raises(InvalidVllmArgs, match="vLLM's DeepSeek-V4 kernels need head_dim 512"):
        build_engine({"engine": "vllm", "model": str(tmp_path)})


def test_the_v4_flash_configuration_uses_only_real_vllm_arguments():
    """Every key of the 8-GPU DeepSeek-V4-Flash model.json is an AsyncEngineArgs field, and its
    nested values (compilation_config) pass vLLM's own validation."""
    from vllm.config import CUDAGraphMode

    args = json.loads(V4_FLASH_MODEL_JSON.read_text())
    assert args["engine"] == "vllm"
    engine = build_engine(args)  # checks the names, builds AsyncEngineArgs; loads nothing
    ea = engine.engine_args
    assert (ea.data_parallel_size, ea.tensor_parallel_size, ea.enable_expert_parallel) == (8, 1, True)
    assert (ea.kv_cache_dtype, ea.block_size, ea.enable_prefix_caching, ea.swa_bounded_replay) == ("fp8", 256, True, True)
    assert ea.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_sampling_parameters_map_to_vllm_deltas():
    from vllm.sampling_params import RequestOutputKind

    from backend.vllm_engine import to_vllm_sampling

    ours = SamplingParams(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.05, seed=3,
                          stop=["x"], stop_token_ids=[5], ignore_eos=True, logprobs=2, skip_special_tokens=False,
                          prompt_logprobs=3)
    theirs = to_vllm_sampling(ours)
    assert theirs.output_kind == RequestOutputKind.DELTA and theirs.n == 1
    assert (theirs.max_tokens, theirs.min_tokens, theirs.temperature, theirs.top_p, theirs.min_p) == (7, 2, 0.5, 0.9, 0.05)
    assert theirs.top_k in (0, -1)  # off
    assert (theirs.seed, theirs.stop, theirs.stop_token_ids, theirs.ignore_eos) == (3, ["x"], [5], True)
    assert (theirs.logprobs, theirs.skip_special_tokens, theirs.prompt_logprobs) == (2, False, 3)
    assert to_vllm_sampling(SamplingParams(top_k=5)).top_k == 5
    with pytest.raises(InvalidRequest):
        to_vllm_sampling(SamplingParams(temperature=-1.0))


# ------------------------------------------------------------------ one started engine


@pytest.fixture(scope="module")
def engine(vllm_checkpoint):
    loop = asyncio.new_event_loop()
    eng = build_engine({**ENGINE_ARGS, "model": str(vllm_checkpoint)})
    loop.run_until_complete(eng.start())
    eng.run = loop.run_until_complete
    yield eng
    if eng.health():
        loop.run_until_complete(eng.shutdown())
    loop.close()


async def collect(stream):
    return [out async for out in stream]


async def settled_stats(eng, timeout_s: float = 5.0) -> dict:
    """stats() once the engine reports nothing running (vLLM sends stats with each engine step)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = eng.stats()
        if stats["running"] == 0 or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


def request(rid, prompt=PROMPT, **sampling):
    return GenerationRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))


@pytest.mark.slow
def test_deltas_counters_and_logprobs(engine):
    outs = engine.run(collect(engine.add(request("d1", max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert [o.num_output_tokens for o in outs] == list(range(1, 7))  # one token per delta, cumulative count
    assert sum(len(o.token_ids) for o in outs) == 6 and outs[-1].num_prompt_tokens >= 4
    steps = [step for o in outs for step in o.logprobs]
    assert len(steps) == 6 and all(2 <= len(step) <= 3 for step in steps)  # top-2 plus the sampled token
    sampled = [step[token] for o in outs for step, token in zip(o.logprobs, o.token_ids)]
    assert outs[-1].cumulative_logprob == pytest.approx(sum(sampled), abs=1e-4)
    assert engine.health()


@pytest.mark.slow
def test_abort_ends_the_stream_with_abort_and_frees_the_cache(engine):
    async def run():
        outs = []
        async for out in engine.add(request("a1", max_tokens=400, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 3:
                assert engine.stats()["running"] == 1
                await engine.abort("a1")
        return outs, await settled_stats(engine)

    outs, stats = engine.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 400
    assert stats["running"] == 0 and stats["kv_usage"] == {"all": 0.0}


@pytest.mark.slow
def test_a_consumer_that_goes_away_aborts_the_request(engine):
    async def run():
        stream = engine.add(request("g1", max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        assert engine.stats()["running"] == 1
        await stream.aclose()  # what a cancelled or disconnected Triton request does
        return await settled_stats(engine)

    stats = engine.run(run())
    assert stats["running"] == 0 and stats["kv_usage"] == {"all": 0.0}


@pytest.mark.slow
def test_a_stop_string_finishes_with_stop(engine):
    free = "".join(o.text for o in engine.run(collect(engine.add(request("s1", max_tokens=12, temperature=0,
                                                                            ignore_eos=True)))))
    stop = free[len(free) // 2:][:3]
    assert stop.strip(), free
    outs = engine.run(collect(engine.add(request("s2", max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))))
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop" and text == free[:free.index(stop)]


@pytest.mark.slow
def test_seeded_sampling_repeats_and_token_prompts_are_served(engine):
    texts = ["".join(o.text for o in engine.run(collect(engine.add(
        request(f"seed{i}", max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))))) for i in range(2)]
    assert texts[0] == texts[1] and texts[0]
    by_ids = GenerationRequest("ids", prompt_token_ids=[0, 11, 12, 13], sampling=SamplingParams(max_tokens=3))
    outs = engine.run(collect(engine.add(by_ids)))
    assert outs[-1].num_prompt_tokens == 4 and outs[-1].num_output_tokens >= 1


@pytest.mark.slow
def test_a_prompt_longer_than_max_model_len_is_the_clients_mistake(engine):
    with pytest.raises(InvalidRequest, match="max_model_len=512"):
        engine.run(collect(engine.add(request("long", prompt="token " * 2000))))


@pytest.mark.slow
def test_max_num_queued_reqs_refuses_with_engine_overloaded(engine):
    async def run():
        streams = [engine.add(request(f"q{i}", max_tokens=400, ignore_eos=True)) for i in range(4)]
        try:
            for stream in streams:
                await stream.__anext__()
            with pytest.raises(EngineOverloaded, match="busy"):
                await engine.add(request("q4", max_tokens=4)).__anext__()
        finally:
            for stream in streams:
                await stream.aclose()
        return await settled_stats(engine)

    assert engine.run(run())["running"] == 0


@pytest.mark.slow
def test_prefix_cache_hits_are_counted(engine):
    prompt = " ".join([PROMPT] * 40)
    before = engine.stats()
    outs = [engine.run(collect(engine.add(request(f"p{i}", prompt=prompt, max_tokens=2)))) for i in range(2)]
    after = engine.stats()
    assert outs[0][-1].num_cached_tokens == 0 and outs[1][-1].num_cached_tokens >= 32
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == outs[1][-1].num_cached_tokens
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] >= 2 * outs[0][-1].num_prompt_tokens
    assert after["prefix_cache_replayed_tokens"] == 0 and after["num_preemptions"] == 0


@pytest.mark.slow
def test_shutdown_then_unhealthy_and_refusing(engine):  # last: it stops the module's engine
    engine.run(engine.shutdown(drain_timeout_s=1.0))
    assert not engine.health()
    with pytest.raises(EngineDead):
        engine.run(collect(engine.add(request("late"))))
