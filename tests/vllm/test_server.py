"""`"engine": "vllm"` through a real tritonserver: the native engine's server tests
(tests/backend/test_server.py), unchanged, run again here against vLLM serving a tiny Llama
(the `triton_server` fixture of tests/vllm/conftest.py), plus what is vLLM's own: engine-argument
errors and prefix-cache metrics fed by vLLM's stat loggers."""

from __future__ import annotations

import time

import pytest

from backend.serve import ServerError, TritonServer
from loadtest.scrape import metrics_text
from tests.backend.test_server import (  # noqa: F401 - fixtures and tests, collected here as well
    PROMPT,
    grpc_client,
    http_client,
    metric,
    offline,
    test_admin_apis_need_the_key,
    test_bad_inputs_are_invalid_arg_while_a_good_request_completes,
    test_cancelling_a_stream_aborts_the_engine_request,
    test_every_return_output,
    test_exclude_input_in_output,
    test_genai_perf_style_payload,
    test_greedy_matches_the_engine_offline_over_grpc_and_http,
    test_metrics_families_have_plausible_values,
    test_streams_arrive_as_several_deltas,
)
from tests.vllm import VLLM_CPU_ARGS, needs_vllm

# Left out: test_an_overloaded_engine_refuses_with_a_clear_message sets the native
# max_waiting_requests; vLLM's max_num_queued_reqs is tested in test_vllm_engine.py.
pytestmark = [pytest.mark.slow, needs_vllm]


def test_prefix_cache_hits_reach_the_metrics(triton_server, grpc_client):  # noqa: F811 - the fixture
    long_prompt = " ".join([PROMPT] * 40)  # several full 32-token blocks
    before = metric(metrics_text(triton_server.metrics_url), "deepseek:prefix_cache_hit_tokens_total") or 0
    first = grpc_client.generate(long_prompt, max_tokens=2, temperature=0)
    second = grpc_client.generate(long_prompt, max_tokens=2, temperature=0)
    assert first.text == second.text
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = metrics_text(triton_server.metrics_url)
        if (metric(text, "deepseek:prefix_cache_hit_tokens_total") or 0) >= before + 32:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no prefix-cache hit was counted:\n{text}")
    assert metric(text, "deepseek:prefix_cache_queries_total") >= metric(text, "deepseek:prefix_cache_hit_tokens_total")
    assert metric(text, "deepseek:replayed_tokens_total") == 0  # vLLM exports no replay counter


def test_unknown_engine_arguments_fail_the_load_with_a_clear_message(vllm_checkpoint):
    args = {**VLLM_CPU_ARGS, "max_num_seq": 4, "max_waiting_requests": 8}
    with pytest.raises(ServerError) as failure:
        with TritonServer(model=str(vllm_checkpoint), engine_args=args, http_port=0, grpc_port=0,
                          metrics_port=0, startup_timeout_s=300):
            pass
    message = str(failure.value)
    assert "unknown vLLM engine argument(s) in model.json" in message, message
    assert "'max_num_seq' (did you mean 'max_num_seqs'?)" in message, message
    assert "'max_waiting_requests' is a native-engine argument (vLLM's nearest: 'max_num_queued_reqs')" in message
