"""Cancellation and disconnects through a real server: 50 gRPC streams cancelled in flight (34
of them queued, the others decoding or in a chunked prefill) and HTTP streams whose sockets close
leave zero requests in the engine and every KV block free (the deepseek: gauges), and the server
serves on."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from loadtest.chaos import (
    MODEL,
    GrpcCall,
    engine_gauges,
    good_tensors,
    grpc_tensors,
    http_disconnect,
    is_idle,
    server_counts,
    wait_idle,
)
from tests.reliability.conftest import run_grpc

pytestmark = pytest.mark.slow

STORM = 50
MAX_NUM_SEQS = 16  # conftest.ENGINE_ARGS


def _wait_gauges(server, ok, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = engine_gauges(server.metrics_url)
        if ok(g):
            return g
        time.sleep(0.2)
    pytest.fail(f"the engine gauges never got there: {g}\n{server.log_tail()}")


def test_fifty_cancellations_in_flight_leave_no_request_and_a_full_block_pool(server):
    before = server_counts(server.metrics_url)
    cancel = threading.Event()
    received = [0] * STORM
    rng = random.Random(0)
    # long prompts (~400 tokens) prefill over several 64-token steps; the rest decode
    prompts = [" ".join(["word"] * (400 if i % 5 == 0 else 8)) + f" {i}" for i in range(STORM)]

    def one(i: int):
        call = GrpcCall(server.grpc_url)
        try:
            call.client.start_stream(callback=lambda result, error: received.__setitem__(i, received[i] + 1))
            call.client.async_stream_infer(MODEL, grpc_tensors(good_tensors(
                prompts[i], {"max_tokens": 480, "ignore_eos": True, "seed": rng.randint(0, 99)})),
                enable_empty_final_response=True)
            cancel.wait(timeout=120)
            call.client.stop_stream(cancel_requests=True)
        finally:
            call.close()

    with concurrent.futures.ThreadPoolExecutor(STORM) as pool:
        futures = [pool.submit(one, i) for i in range(STORM)]
        # every request in flight: 16 running, the other 34 queued behind them
        g = _wait_gauges(server, lambda g: g["running"] == MAX_NUM_SEQS and g["waiting"] == STORM - MAX_NUM_SEQS)
        assert g["free_compressed"] < g["total_compressed"]
        at_cancel = list(received)
        cancel.set()
        for f in futures:
            f.result(timeout=120)
    decoding = sum(1 for r in at_cancel if r > 0)
    assert 1 <= decoding <= MAX_NUM_SEQS and STORM - decoding >= STORM - MAX_NUM_SEQS

    g = wait_idle(server.metrics_url, timeout_s=30)
    assert is_idle(g), g  # zero running, zero waiting, every block of every pool free
    after = server_counts(server.metrics_url)
    assert after.get("success:abort", 0) - before.get("success:abort", 0) == STORM
    # counted once, as an abort: a client's cancel is no server failure
    assert after.get("failure:CANCELLED", 0) - before.get("failure:CANCELLED", 0) == 0
    outcome, message, _, _ = run_grpc(server.grpc_url, "after the storm", max_tokens=8)
    assert outcome == "completed", message
    # counters reach Triton's metrics through the model's metrics thread: let this one land
    # before the next test takes its baseline
    deadline = time.monotonic() + 10
    while server_counts(server.metrics_url).get("success:length", 0) <= after.get("success:length", 0):
        assert time.monotonic() < deadline, "the completed request was never counted"
        time.sleep(0.1)


def test_http_disconnects_abort_their_requests(server):
    before = server_counts(server.metrics_url)
    rng = random.Random(1)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        # streams closed before any byte, after the headers, mid-stream; FIN or RST
        list(pool.map(lambda i: http_disconnect(server.http_url, f"disconnect {i} " * (1 + i % 7), 480, True,
                                                [0, 1, 64][i % 3], rng), range(12)))
    g = wait_idle(server.metrics_url, timeout_s=30)
    assert is_idle(g), g
    after = server_counts(server.metrics_url)
    # each one aborted in the engine (none ran its 480 tokens to the end)
    assert after.get("success:abort", 0) - before.get("success:abort", 0) == 12
    assert not after.get("success:length", 0) - before.get("success:length", 0)
