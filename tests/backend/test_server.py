"""A real tritonserver (backend.serve) with the deepseek backend and the tiny checkpoint:
the wire protocol end to end over gRPC and HTTP, cancellation, errors, metrics, admin APIs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import math
import re
import time
import urllib.request

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.engine_setup import build_engine, load_engine_args, pop_backend_options
from client.grpc import GrpcClient
from client.http import HttpClient
from client.types import ServerError
from engine.llm import LLM
from engine.request import GenerationRequest, SamplingParams
from loadtest.scrape import metric, metrics_text

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
ALL_RETURNS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
               "return_cumulative_logprob", "return_logprobs")


@pytest.fixture(scope="module")
def grpc_client(triton_server):
    with GrpcClient(triton_server.grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def http_client(triton_server):
    return HttpClient(triton_server.http_url)


@pytest.fixture(scope="module")
def offline(triton_server):
    """Greedy text from the same engine, same model.json, run in this process."""
    args = load_engine_args(triton_server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json")
    pop_backend_options(args)

    async def run(prompts, max_tokens):
        engine = build_engine(args)
        await engine.start()
        try:
            texts = []
            for i, prompt in enumerate(prompts):
                sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
                request = GenerationRequest(request_id=f"offline-{i}", prompt=prompt, sampling=sampling)
                texts.append("".join([out.text async for out in engine.add(request)]))
            return texts
        finally:
            await engine.shutdown()

    prompts = [PROMPT, "Hello", "Grüße, 世界 🙂"]  # the last: multi-byte text both ways through BYTES tensors
    return dict(zip(prompts, asyncio.run(run(prompts, 12))))


def raw_generate(server, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.http_url.split(":")[0], int(server.http_url.split(":")[1]), timeout=60)
    conn.request("POST", "/v2/models/deepseek_v4/generate", body=json.dumps(body), headers=headers or {})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read() or b"{}")
    conn.close()
    return status, payload


# ------------------------------------------------------------------------------------------ outputs


def test_greedy_matches_the_engine_offline_over_grpc_and_http(grpc_client, http_client, offline):
    for prompt, expected in offline.items():
        assert expected, "the offline run generated nothing"
        assert grpc_client.generate(prompt, max_tokens=12, temperature=0).text == expected
        assert http_client.generate(prompt, max_tokens=12, temperature=0).text == expected
        assert "".join(d.text for d in grpc_client.generate_stream(prompt, max_tokens=12, temperature=0)) == expected
        assert "".join(d.text for d in http_client.generate_stream(prompt, max_tokens=12, temperature=0)) == expected


def test_concurrent_streams_each_arrive_whole_and_in_order(triton_server, offline):
    """Several response threads send; each request's deltas stay in order on one of them."""
    def stream(prompt: str) -> list:
        with GrpcClient(triton_server.grpc_url) as client:
            return list(client.generate_stream(prompt, max_tokens=12, temperature=0))

    prompts = list(offline) * 3
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(stream, prompts))
    for prompt, deltas in zip(prompts, results):
        assert "".join(d.text for d in deltas) == offline[prompt]
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1) and deltas[-1].finish_reason


def test_streams_arrive_as_several_deltas(grpc_client, http_client):
    for client in (grpc_client, http_client):
        deltas = list(client.generate_stream(PROMPT, max_tokens=8, temperature=0, ignore_eos=True))
        assert len(deltas) >= 2
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == "length"
        assert sum(d.num_output_tokens for d in deltas) == 8
        assert deltas[0].time_s <= deltas[-1].time_s


def test_exclude_input_in_output(triton_server, grpc_client, http_client, offline):
    for client in (grpc_client, http_client):
        for prompt in (PROMPT, "Grüße, 世界 🙂"):
            echoed = client.generate(prompt, max_tokens=12, temperature=0, exclude_input_in_output=False)
            assert echoed.text == prompt + offline[prompt]
    # without the flag a non-streaming request echoes the prompt (Triton's vLLM backend default);
    # sampling keys also arrive as request parameters (HTTP generate's "parameters" object)
    status, payload = raw_generate(triton_server, {"text_input": PROMPT,
                                                   "parameters": {"max_tokens": 12, "temperature": 0}})
    assert status == 200, payload
    assert payload["text_output"] == PROMPT + offline[PROMPT]


@pytest.mark.parametrize("stream", [False, True])
def test_every_return_output(grpc_client, stream):
    kwargs = dict(max_tokens=6, temperature=0, ignore_eos=True, returns=ALL_RETURNS)
    if stream:
        deltas = list(grpc_client.generate_stream(PROMPT, **kwargs))
    else:
        deltas = grpc_client.generate(PROMPT, **kwargs).deltas
        assert len(deltas) == 1
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.num_input_tokens and last.num_input_tokens >= 3
    assert sum(d.num_output_tokens for d in deltas) == 6
    logprobs = [step for d in deltas for step in d.logprobs]
    assert len(logprobs) == 6 and all(len(step) >= 1 for step in logprobs)
    sampled = [max(step.values(), key=lambda v: v["logprob"])["logprob"] for step in logprobs]
    assert all(lp <= 0 for lp in sampled)
    assert last.cumulative_logprob <= 0 and math.isfinite(last.cumulative_logprob)
    assert last.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-3)


def test_genai_perf_style_payload(triton_server):
    """Exactly what genai-perf --backend vllm sends: no return flags, max_tokens as a string."""
    responses = []
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    inputs = []
    for name, value, dtype in [("text_input", PROMPT.encode(), "BYTES"), ("stream", True, "BOOL"),
                               ("exclude_input_in_output", True, "BOOL"),
                               ("sampling_parameters", json.dumps({"max_tokens": "16"}).encode(), "BYTES")]:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        inputs.append(tensor)
    client.async_stream_infer("deepseek_v4", inputs)
    client.stop_stream()  # waits for the stream to end: the model sent its final response
    client.close()
    assert responses and all(error is None for _, error in responses), responses
    text = "".join(r.as_numpy("text_output")[0].decode() for r, _ in responses)
    assert 1 <= len(responses) <= 16 and text


# ------------------------------------------------------------------------------------------ cancel


def test_cancelling_a_stream_aborts_the_engine_request(triton_server, grpc_client):
    before = metrics_text(triton_server.metrics_url)
    aborted_before = metric(before, "deepseek:request_success_total", finished_reason="abort") or 0
    stream = grpc_client.generate_stream(PROMPT, max_tokens=480, ignore_eos=True)
    seen_running = False
    received = 0
    for _ in stream:
        received += 1
        if received % 5 == 0:
            seen_running = seen_running or (metric(metrics_text(triton_server.metrics_url), "deepseek:num_requests_running") or 0) >= 1
        if seen_running and received >= 3:
            break
    stream.close()  # stop_stream(cancel_requests=True)
    assert seen_running and received < 480
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = metrics_text(triton_server.metrics_url)
        aborted = metric(text, "deepseek:request_success_total", finished_reason="abort") or 0
        if aborted == aborted_before + 1 and metric(text, "deepseek:num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the cancelled request was not aborted in the engine:\n{triton_server.log_tail()}")
    # the client goes on, on a new stream; requests that finish leave theirs open for the next
    first = grpc_client.generate(PROMPT, max_tokens=4, temperature=0)
    stream_after_first = grpc_client._responses
    second = grpc_client.generate(PROMPT, max_tokens=4, temperature=0)
    assert first.text == second.text and first.finish_reason == "length"
    assert stream_after_first is not None and grpc_client._responses is stream_after_first


# ------------------------------------------------------------------------------------------ errors

BAD_HTTP_BODIES = [
    ({"sampling_parameters": "{not json"}, "sampling_parameters is not valid JSON"),
    ({"sampling_parameters": "[1]"}, "sampling_parameters must be a JSON object"),
    ({"sampling_parameters": json.dumps({"bogus": 1})}, "unknown sampling parameter 'bogus'"),
    ({"sampling_parameters": json.dumps({"max_tokens": "lots"})}, "max_tokens must be an integer"),
    ({"sampling_parameters": json.dumps({"max_tokens": -1})}, "max_tokens must be between 1 and 512"),
    ({"sampling_parameters": json.dumps({"max_tokens": 10**9})}, "max_tokens must be between 1 and 512"),
    ({"sampling_parameters": json.dumps({"temperature": -1})}, "temperature must be >= 0"),
    ({"sampling_parameters": json.dumps({"top_p": 0})}, "top_p must be in"),
    ({"sampling_parameters": json.dumps({"top_p": 2})}, "top_p must be in"),
    ({"parameters": {"temperature": "warm"}}, "temperature must be a number"),
    ({"text_input": ""}, "text_input is empty"),
    ({"stream": True, "exclude_input_in_output": False}, "exclude_input_in_output=false is not allowed"),
    ({"text_input": "token " * 2000}, "max_model_len"),  # the engine's InvalidRequest
]


def test_bad_inputs_are_invalid_arg_while_a_good_request_completes(triton_server, grpc_client):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: list(grpc_client.generate_stream(PROMPT, max_tokens=24, ignore_eos=True)))
        for override, message in BAD_HTTP_BODIES:
            body = {"text_input": PROMPT, **override}
            status, payload = raw_generate(triton_server, body)
            assert status == 400, (override, payload)
            assert message in payload.get("error", ""), (override, payload)
        status, payload = raw_generate(triton_server, {"parameters": {"max_tokens": 4}})
        assert status == 400 and "text_input" in payload["error"], payload
        # non-UTF-8 bytes can only travel in a binary tensor: gRPC
        with pytest.raises(ServerError, match="text_input is not valid UTF-8"):
            inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
            inputs[0].set_data_from_numpy(np.array([b"\xff\xfe bad"], dtype=np.object_))
            _grpc_raw(triton_server, inputs)
        deltas = good.result(timeout=120)
    assert deltas[-1].finish_reason == "length" and sum(d.num_output_tokens for d in deltas) == 24
    assert triton_server.is_ready()


def _grpc_raw(server, inputs):
    responses = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    client.async_stream_infer("deepseek_v4", inputs)
    client.stop_stream()
    client.close()
    for _, error in responses:
        if error is not None:
            raise ServerError("ERROR", error.message())
    return responses


# ------------------------------------------------------------------------------------------ sampling


def test_tiny_temperature_and_top_p_are_greedy_and_preempt_nothing(triton_server, grpc_client, http_client, offline):
    """Once: INTERNAL 'probability tensor contains inf/nan', and every running request preempted."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        normal = pool.submit(lambda: list(grpc_client.generate_stream(PROMPT, max_tokens=24, ignore_eos=True)))
        tiny = [pool.submit(http_client.generate, PROMPT, max_tokens=12, **kw)
                for kw in ({"temperature": 1e-40}, {"temperature": "1e-39", "seed": 3},
                           {"temperature": 0.8, "top_p": 1e-300, "seed": 4})]
        texts = [f.result(timeout=120).text for f in tiny]
        deltas = normal.result(timeout=120)
    assert texts == [offline[PROMPT]] * 3  # greedy (a top_p that small keeps the top token only)
    assert deltas[-1].finish_reason == "length" and sum(d.num_output_tokens for d in deltas) == 24
    time.sleep(1.2)  # the metrics thread polls engine stats
    assert metric(metrics_text(triton_server.metrics_url), "deepseek:num_preemptions_total") == 0


def test_penalties_and_logit_bias_change_greedy_text_and_a_masked_request_fails_alone(triton_server, grpc_client,
                                                                                     http_client, offline):
    penalized = grpc_client.generate(PROMPT, max_tokens=12, temperature=0, repetition_penalty=1.8,
                                     presence_penalty=1.0, frequency_penalty=1.0, logit_bias={"7": 5.0})
    assert penalized.text and penalized.text != offline[PROMPT]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        normal = pool.submit(lambda: list(grpc_client.generate_stream(PROMPT, max_tokens=24, ignore_eos=True)))
        # min_tokens bans the EOS id, allowed_token_ids allows only it: nothing can be sampled
        with pytest.raises(ServerError, match="every token is masked"):
            http_client.generate(PROMPT, max_tokens=8, temperature=0, min_tokens=4, allowed_token_ids=[1])
        with pytest.raises(ServerError, match="HTTP 400.*presence_penalty must be in"):
            http_client.generate(PROMPT, max_tokens=8, presence_penalty=3)
        deltas = normal.result(timeout=120)
    assert sum(d.num_output_tokens for d in deltas) == 24
    assert triton_server.is_ready()


def test_structured_outputs_and_guided_keys_over_the_wire(triton_server, grpc_client, http_client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}
    out = http_client.generate(PROMPT, max_tokens=40, temperature=1.0, seed=1,
                               structured_outputs={"json": schema, "disable_any_whitespace": True})
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    chosen = grpc_client.generate(PROMPT, max_tokens=20, temperature=1.0, seed=2, guided_choice=["left", "right"])
    assert chosen.text in ("left", "right")
    assert re.fullmatch(r"[0-9]{3}", grpc_client.generate(PROMPT, max_tokens=20, guided_regex="[0-9]{3}").text)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        normal = pool.submit(lambda: list(grpc_client.generate_stream(PROMPT, max_tokens=24, ignore_eos=True)))
        with pytest.raises(ServerError, match='HTTP 400.*structured_outputs.json cannot be compiled: Unsupported type "nope"'):
            http_client.generate(PROMPT, max_tokens=8, guided_json={"type": "nope"})
        with pytest.raises(ServerError, match="HTTP 400.*exactly one of"):
            http_client.generate(PROMPT, max_tokens=8, structured_outputs={"regex": "a", "choice": ["b"]})
        deltas = normal.result(timeout=120)
    assert sum(d.num_output_tokens for d in deltas) == 24


def test_detokenize_false_returns_the_token_ids(triton_server):
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    status, ids = raw_generate(triton_server, {"text_input": PROMPT, "exclude_input_in_output": True,
                                               "sampling_parameters": json.dumps({**sampling, "detokenize": False})})
    assert status == 200 and ids["text_output"] == "" and len(ids["output_token_ids"]) == 6, ids
    status, text = raw_generate(triton_server, {"text_input": PROMPT, "return_logprobs": True,
                                                "sampling_parameters": json.dumps(sampling)})
    assert status == 200 and "output_token_ids" not in text
    assert ids["output_token_ids"] == [int(next(iter(step))) for step in json.loads(text["logprobs"])]


def test_prompt_logprobs_over_the_wire_every_position_despite_the_prefix_cache(triton_server):
    """The server's model.json has prefix caching on: a repeated prompt still gets every position."""
    args = load_engine_args(triton_server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json")
    pop_backend_options(args)
    args.pop("engine", None)
    args.pop("engine_core_process", None)
    local = LLM(args)  # the same engine in this process: the oracle
    ids = local.tokenizer.encode(PROMPT * 3)
    want = local.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))[0]
    sampling = json.dumps({"max_tokens": 3, "temperature": 0, "prompt_logprobs": 2})
    for _ in range(2):
        status, out = raw_generate(triton_server, {"text_input": PROMPT * 3, "return_num_input_tokens": True,
                                                   "sampling_parameters": sampling})
        assert status == 200, out
        got = json.loads(out["prompt_logprobs"])
        assert len(got) == len(ids) == out["num_input_tokens"] and got[0] is None
        for p, (step, ref, rank) in enumerate(zip(got[1:], want.prompt_logprobs[1:], want.prompt_logprob_ranks[1:])):
            assert [int(t) for t in step] == list(ref) and int(next(iter(step))) == ids[p + 1]
            assert all(abs(step[str(t)]["logprob"] - v) <= 1e-3 for t, v in ref.items())
            assert step[str(ids[p + 1])]["rank"] == rank and step[str(ids[p + 1])]["decoded_token"] is not None
    # streamed over gRPC: the first response carries them, once
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([(PROMPT * 3).encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([sampling.encode()], dtype=np.object_))
    carried = [r.as_numpy("prompt_logprobs") for r, _ in _grpc_raw(triton_server, inputs) if r is not None]
    assert carried[0] is not None and all(c is None for c in carried[1:]) and len(carried) >= 2
    assert json.loads(carried[0][0]) == got
    status, out = raw_generate(triton_server, {"text_input": PROMPT, "sampling_parameters": json.dumps(
        {"prompt_logprobs": 21})})
    assert status == 400 and "prompt_logprobs must be between 0 and 20" in out["error"], out


# ------------------------------------------------------------------------------------------ server


def test_metrics_families_have_plausible_values(triton_server, grpc_client):
    grpc_client.generate(PROMPT, max_tokens=5, ignore_eos=True)
    streamed = list(grpc_client.generate_stream(PROMPT, max_tokens=6, ignore_eos=True))
    time.sleep(1.2)  # the metrics thread records finished requests and polls engine stats
    text = metrics_text(triton_server.metrics_url)
    deltas, responses = metric(text, "deepseek:stream_deltas_total"), metric(text, "deepseek:stream_responses_total")
    assert deltas >= 6 and len(streamed) <= responses <= deltas  # merged only when the sender falls behind
    assert metric(text, "deepseek:response_thread_cpu_seconds_total") > 0
    assert metric(text, "deepseek:time_to_first_token_seconds_count") >= 1
    assert 0 < metric(text, "deepseek:time_to_first_token_seconds_sum") < 60
    assert metric(text, "deepseek:time_per_output_token_seconds_count") >= 1
    assert metric(text, "deepseek:e2e_request_latency_seconds_count") >= 1
    assert metric(text, "deepseek:e2e_request_latency_seconds_sum") >= metric(
        text, "deepseek:time_to_first_token_seconds_sum")
    assert metric(text, "deepseek:request_prompt_tokens_count") >= 1
    assert metric(text, "deepseek:request_generation_tokens_bucket", le="+Inf") >= 1
    assert metric(text, "deepseek:prompt_tokens_total") >= 3
    assert metric(text, "deepseek:generation_tokens_total") >= 5
    assert metric(text, "deepseek:request_success_total", finished_reason="length") >= 1
    assert metric(text, "deepseek:num_requests_running") == 0
    assert metric(text, "deepseek:num_requests_waiting") == 0
    usage = metric(text, "deepseek:kv_cache_usage_perc")
    assert usage is not None and usage >= 0
    assert metric(text, "deepseek:prefix_cache_hit_tokens_total") is not None
    assert metric(text, "deepseek:replayed_tokens_total") is not None
    assert metric(text, "deepseek:num_preemptions_total") == 0


def test_admin_apis_need_the_key(triton_server):
    host, port = triton_server.http_url.split(":")

    def repository_index(headers):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v2/repository/index", body="{}", headers=headers)
        response = conn.getresponse()
        status, body = response.status, response.read().decode()
        conn.close()
        return status, body

    status, body = repository_index({})
    assert status != 200 and "admin-key" in body, (status, body)
    # model control (a load with override files runs code) is shut unless --allow-model-control
    status, body = repository_index({"admin-key": triton_server.admin_key})
    assert status != 200, (status, body)

    def shared_memory_status(headers):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v2/systemsharedmemory/status", headers=headers)
        response = conn.getresponse()
        status = response.status
        response.read()
        conn.close()
        return status

    assert shared_memory_status({}) != 200
    assert shared_memory_status({"admin-key": triton_server.admin_key}) == 200
    # inference stays open
    assert urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/deepseek_v4/ready").status == 200


def test_an_overloaded_engine_refuses_with_a_clear_message():
    """max_waiting_requests=0: the engine admits nothing (UNAVAILABLE), and the server stays up."""
    from backend.serve import TritonServer

    with TritonServer(engine_args={"max_model_len": 128, "max_waiting_requests": 0}, http_port=0, grpc_port=0,
                      metrics_port=0) as server:
        status, payload = raw_generate(server, {"text_input": PROMPT})
        assert status != 200 and "engine overloaded" in payload["error"], payload
        assert server.is_ready()
