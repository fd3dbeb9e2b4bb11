"""A real tritonserver for the reliability tests: the tiny checkpoint in float32 without prefix
caching (greedy text then depends neither on the batch nor on a recompute, which a prefix-cache
hit with SWA bounded replay would only approximate, so "unharmed" can mean "the same text"),
room for a 50-request storm (16 running + 64 waiting), small prefill chunks (long prompts
prefill over several steps) and the test-only fault injection marker."""

from __future__ import annotations

import http.client
import json

import pytest

from backend.serve import TritonServer
from client.grpc import GrpcClient
from loadtest.chaos import GrpcCall, good_tensors

MARKER = "INJECT-FAULT-7f3a"
ENGINE_ARGS = {"dtype": "float32", "enable_prefix_caching": False, "max_model_len": 512, "max_num_seqs": 16,
               "max_waiting_requests": 64, "max_num_batched_tokens": 64, "fault_injection_marker": MARKER}


@pytest.fixture(scope="package")
def server():
    with TritonServer(engine_args=ENGINE_ARGS, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=300) as s:
        yield s


@pytest.fixture
def grpc_client(server):
    with GrpcClient(server.grpc_url) as client:
        yield client


def run_grpc(url: str, prompt: str, **kwargs):
    """One request through chaos's GrpcCall: (outcome, error message, responses, seconds)."""
    stream = kwargs.pop("stream", True)
    call = GrpcCall(url)
    try:
        return call.run(good_tensors(prompt, kwargs, stream=stream))
    finally:
        call.close()


def http_generate(url: str, body: dict, timeout_s: float = 60) -> tuple[int, dict]:
    """POST /generate with `body` as is: (status, JSON payload)."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v2/models/deepseek_v4/generate", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()
