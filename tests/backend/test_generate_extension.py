"""Triton's generate extension as its documentation shows it (docs/protocol/extension_generate.md),
verbatim, against the session's real tritonserver: the example request, the optional top-level
"id" echoed in every response, generate_stream's events, and the error object."""

from __future__ import annotations

import http.client
import json

import pytest

pytestmark = pytest.mark.slow

# docs/protocol/extension_generate.md, "Example Request" (the model name is ours)
DOCUMENTED_REQUEST = '{"text_input": "client input", "parameters": {"stream": false, "temperature": 0}}'
# the same with the schema's optional "id" (`$generate_request = {"id": $string #optional, ...}`)
WITH_ID = '{"id": "42", "text_input": "client input", "parameters": {"stream": false, "temperature": 0}}'


def post(server, path: str, body: str) -> tuple[int, str, bytes]:
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/v2/models/deepseek_v4/{path}", body=body)
    response = conn.getresponse()
    result = response.status, response.getheader("Content-Type"), response.read()
    conn.close()
    return result


def test_the_documented_example_request(triton_server):
    status, content_type, body = post(triton_server, "generate", DOCUMENTED_REQUEST)
    assert status == 200 and content_type == "application/json"
    response = json.loads(body)
    assert set(response) == {"model_name", "model_version", "text_output"}  # the documented response object
    assert response["model_name"] == "deepseek_v4" and response["model_version"] == "1"
    assert response["text_output"].startswith("client input")  # not streaming: the prompt is echoed


def test_a_top_level_id_is_accepted_and_echoed(triton_server):
    status, _, body = post(triton_server, "generate", WITH_ID)
    assert status == 200, body
    with_id = json.loads(body)
    assert with_id["id"] == "42"
    plain = json.loads(post(triton_server, "generate", DOCUMENTED_REQUEST)[2])
    assert with_id["text_output"] == plain["text_output"]  # the id changes nothing else

    body = '{"id": "42", "text_input": "client input", "stream": true, "return_finish_reason": true, ' \
           '"parameters": {"temperature": 0, "max_tokens": 4}}'
    status, content_type, raw = post(triton_server, "generate_stream", body)
    assert status == 200 and content_type.startswith("text/event-stream")
    events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 2 and all(e["id"] == "42" for e in events)
    # vllm_backend's finish_reason: "None" until the last event
    assert [e["finish_reason"] for e in events[:-1]] == ["None"] * (len(events) - 1)
    assert events[-1]["finish_reason"] == "length"


def test_the_documented_error_object(triton_server):
    status, _, body = post(triton_server, "generate", '{"text_input": "client input", "parameters": {"bogus": 1}}')
    assert status == 400 and set(json.loads(body)) == {"error"}
    assert "unknown sampling parameter 'bogus'" in json.loads(body)["error"]


def test_logprobs_carry_rank_and_decoded_token(triton_server):
    body = '{"text_input": "client input", "return_logprobs": true, "parameters": {"temperature": 0, ' \
           '"max_tokens": 3, "logprobs": 2}}'
    status, _, raw = post(triton_server, "generate", body)
    assert status == 200, raw
    steps = json.loads(json.loads(raw)["logprobs"])
    assert len(steps) == 3
    for step in steps:
        entries = list(step.values())
        assert entries[0]["rank"] == 1  # greedy: the sampled token (first, as vLLM orders) is the top one
        assert sorted(e["rank"] for e in entries) == [1, 2]
        assert all(isinstance(e["decoded_token"], str) for e in entries)
