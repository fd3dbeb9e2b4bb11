"""Admission control and a fatal engine error, on a small server of their own (4 running, 4
waiting): a burst gets UNAVAILABLE at once for the excess and every admitted request completes;
then a fatal error marks the model not ready and everything is answered UNAVAILABLE, nothing
hangs. (The fatal test kills this server's engine: it runs last here.)"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.error
import urllib.request

import pytest

from backend.serve import TritonServer
from loadtest.chaos import GrpcCall, error_code, good_tensors, wait_idle
from tests.reliability.conftest import MARKER, http_generate, run_grpc

pytestmark = pytest.mark.slow

BURST = 40
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def small_server():
    # no restart budget: a fatal error leaves the engine core dead, so the model unloads at once
    # (restarts: tests/reliability/test_core_process.py)
    args = {"max_model_len": 256, "max_num_seqs": 4, "max_waiting_requests": 4, "fault_injection_marker": MARKER,
            "core_restart_limit": 0}
    with TritonServer(engine_args=args, http_port=0, grpc_port=0, metrics_port=0, startup_timeout_s=300) as s:
        yield s


def test_a_burst_gets_fast_unavailable_and_every_admitted_request_completes(small_server):
    barrier = threading.Barrier(BURST)

    def one(i: int):
        call = GrpcCall(small_server.grpc_url)
        try:
            return call.run(good_tensors(f"burst {i}", {"max_tokens": MAX_TOKENS, "ignore_eos": True}, stream=False),
                            barrier=barrier)
        finally:
            call.close()

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(one, range(BURST)))
    completed = [r for r in results if r[0] == "completed"]
    refused = [r for r in results if r[0] != "completed"]
    assert refused and completed
    for outcome, message, _, _ in refused:
        assert outcome == "error" and message.startswith("UNAVAILABLE: engine overloaded"), message
    for _, _, responses, _ in completed:
        assert int(responses[0].as_numpy("num_output_tokens")[0]) == MAX_TOKENS
        assert responses[0].as_numpy("finish_reason")[0] == b"length"
    # refused at once, not after waiting for a slot: faster than any admitted request finished
    assert max(r[3] for r in refused) < min(r[3] for r in completed)
    assert len(completed) >= 4  # at least max_waiting_requests (a burst within one step fills only the queue)

    # the load is gone: admission recovers
    assert wait_idle(small_server.metrics_url)["running"] == 0
    assert run_grpc(small_server.grpc_url, "after the burst", max_tokens=4)[0] == "completed"
    status, payload = http_generate(small_server.http_url, {"text_input": "after", "parameters": {"max_tokens": 4}})
    assert status == 200, payload


def test_a_fatal_engine_error_makes_the_model_unready_and_answers_unavailable(small_server):
    in_flight: dict = {}

    def long_stream():
        in_flight["result"] = run_grpc(small_server.grpc_url, "an innocent long stream", max_tokens=200,
                                       ignore_eos=True)

    thread = threading.Thread(target=long_stream)
    thread.start()
    time.sleep(0.5)
    outcome, message, _, _ = run_grpc(small_server.grpc_url, f"{MARKER}:fatal", max_tokens=4, stream=False)
    assert outcome == "error" and message.startswith("UNAVAILABLE: engine dead"), message
    thread.join(timeout=60)
    outcome, message, _, _ = in_flight["result"]
    assert outcome == "error" and error_code(message) == "UNAVAILABLE", message  # not a hang

    # the model unloads itself, so readiness says so
    url = f"http://{small_server.http_url}/v2/models/deepseek_v4/ready"
    deadline = time.monotonic() + 30
    while small_server.models_ready():
        assert time.monotonic() < deadline, "the model stayed ready after a fatal engine error"
        time.sleep(0.2)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url, timeout=5)
    # new requests: refused at once, UNAVAILABLE by Triton's message (the model is gone)
    start = time.monotonic()
    outcome, message, _, _ = run_grpc(small_server.grpc_url, "anyone there?", max_tokens=4)
    assert outcome == "error" and error_code(message) == "UNAVAILABLE", message
    assert time.monotonic() - start < 10
