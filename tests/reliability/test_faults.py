"""An injected engine fault (EngineArgs.fault_injection_marker, test-only) through a real server:
the step that holds the faulty request raises after its forward ran (half a step in the cache);
only that request fails, with INTERNAL; the requests decoding beside it are recomputed and finish
with exactly the text they get without the fault; the block pool is full afterwards."""

from __future__ import annotations

import threading
import time

import pytest

from loadtest.chaos import GrpcCall, error_code, good_tensors, server_counts, wait_idle
from loadtest.scrape import metric, metrics_text
from tests.reliability.conftest import MARKER, http_generate, run_grpc

pytestmark = pytest.mark.slow

PROMPTS = ["The first innocent request", "A second one, a little longer than the first", "Third"]
# long enough that the three decode together across several of the metrics' 0.5 s polls (at 64 tokens the window
# could fall between two polls: the wait below then failed about one run in three)
GREEDY = dict(max_tokens=256, temperature=0, ignore_eos=True)


def _text(responses) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in responses)


def test_an_injected_fault_fails_only_its_request(server):
    alone = [_text(run_grpc(server.grpc_url, p, **GREEDY)[2]) for p in PROMPTS]
    before = server_counts(server.metrics_url)

    results: dict = {}

    def innocent(i: int):
        call = GrpcCall(server.grpc_url)
        try:
            outcome, message, responses, _ = call.run(good_tensors(PROMPTS[i], GREEDY))
        finally:
            call.close()
        results[i] = (outcome, message, _text(responses), responses[-1].as_numpy("finish_reason")[0].decode()
                      if responses else None)

    threads = [threading.Thread(target=innocent, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    # the faulty request arrives while the innocents decode: same batch
    deadline = time.monotonic() + 30
    while (metric(metrics_text(server.metrics_url), "deepseek:num_requests_running") or 0) < len(PROMPTS):
        assert time.monotonic() < deadline, "the innocent requests never ran"
        time.sleep(0.1)
    outcome, message, _, _ = run_grpc(server.grpc_url, f"this one breaks the step {MARKER}", max_tokens=16,
                                      stream=False)
    for t in threads:
        t.join(timeout=120)

    assert outcome == "error" and error_code(message) == "INTERNAL", message
    assert message.startswith("INTERNAL: request failed: engine step failed: InjectedFault"), message
    for i, expected in enumerate(alone):
        outcome_i, message_i, text, reason = results[i]
        assert outcome_i == "completed", message_i
        assert text == expected and reason == "length"  # recomputed after the fault: same greedy text

    g = wait_idle(server.metrics_url, timeout_s=30)
    assert g["running"] == 0 and g["free_compressed"] == g["total_compressed"], g
    assert g["free_window"] == g["total_window"], g
    after = server_counts(server.metrics_url)
    assert after["step_failures"] - before.get("step_failures", 0) >= 1
    assert after.get("failure:INTERNAL", 0) - before.get("failure:INTERNAL", 0) == 1
    assert server.models_ready()

    # over HTTP too: 400 (Triton 2.51's generate), the code leads the message
    status, payload = http_generate(server.http_url, {"text_input": f"{MARKER} again",
                                                      "parameters": {"max_tokens": 4}})
    assert status == 400 and payload["error"].startswith("INTERNAL: request failed"), payload
    assert run_grpc(server.grpc_url, "still serving", max_tokens=4)[0] == "completed"
