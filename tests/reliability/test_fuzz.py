"""Fuzzed bad inputs (loadtest.chaos's hypothesis strategies) through a real server: every one is
refused with INVALID_ARG, over gRPC and HTTP, while a good stream runs through it unharmed.

The code a client sees: our errors start with it ("INVALID_ARG: ..."), since Triton 2.51's HTTP
generate answers 400 for every model error and a gRPC stream error carries only the message;
Triton's own input checks (datatype, shape, unknown input) come without the prefix and are told
by their message (chaos.TRITON_INPUT_ERRORS)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings

from loadtest.chaos import GrpcCall, bad_request, bad_sampling, error_code, server_counts
from loadtest.scrape import metrics_text
from tests.reliability.conftest import http_generate, run_grpc

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GOOD = dict(max_tokens=200, temperature=0, ignore_eos=True)


def _good_stream(url: str, out: dict) -> None:
    outcome, message, responses, _ = run_grpc(url, "A good stream runs through the fuzz", **GOOD)
    out.update(outcome=outcome, message=message, end=time.monotonic(),
               text="".join(r.as_numpy("text_output")[0].decode() for r in responses),
               tokens=sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses),
               reasons=[r.as_numpy("finish_reason")[0].decode() for r in responses])


def test_fuzzed_bad_inputs_get_invalid_arg_while_a_good_stream_completes(server):
    alone: dict = {}
    _good_stream(server.grpc_url, alone)
    assert alone["outcome"] == "completed" and alone["tokens"] == 200

    good: dict = {}
    stream = threading.Thread(target=_good_stream, args=(server.grpc_url, good))
    stream.start()
    time.sleep(0.3)
    before = server_counts(server.metrics_url)
    fuzz_start = time.monotonic()
    seen = {"ours": 0, "triton": 0}

    @FUZZ
    @given(example=bad_request(max_model_len=512))
    def over_grpc(example):
        call = GrpcCall(server.grpc_url)
        try:
            outcome, message, _, seconds = call.run(example.tensors, timeout_s=60)
        finally:
            call.close()
        assert outcome == "error", (example.why, outcome)
        assert error_code(message) == "INVALID_ARG", (example.why, message)
        seen["ours" if message.startswith("INVALID_ARG: ") else "triton"] += 1

    @FUZZ
    @given(sampling=bad_sampling(max_model_len=512))
    def over_http(sampling):
        status, payload = http_generate(server.http_url, {"text_input": "fuzz",
                                                          "sampling_parameters": json.dumps(sampling)})
        assert status == 400, (sampling, payload)
        assert payload.get("error", "").startswith("INVALID_ARG: "), (sampling, payload)

    over_grpc()
    over_http()
    stream.join(timeout=300)
    # our validation answered most; Triton's own checks the rest (wrong datatype / shape / input)
    assert seen["ours"] >= 30 and seen["triton"] >= 1, seen
    # the good stream ran through the fuzz, and the fuzz changed nothing in it
    assert good["outcome"] == "completed", good
    assert good["end"] > fuzz_start
    assert good["text"] == alone["text"] and good["tokens"] == 200 and good["reasons"][-1] == "length"
    after = server_counts(server.metrics_url)
    assert after.get("failure:INVALID_ARG", 0) - before.get("failure:INVALID_ARG", 0) >= seen["ours"]
    assert not any(after.get(k, 0) - before.get(k, 0) for k in ("failure:INTERNAL", "failure:UNAVAILABLE"))
    assert server.models_ready()
    assert "deepseek:engine_step_failures_total" in metrics_text(server.metrics_url)
