"""`python -m loadtest.sweep` against a real tritonserver (the session fixture, tiny checkpoint):
short sweeps over gRPC and HTTP whose every request record must agree with itself and with the
server's own counters, and whose load process must exit on its own."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import chaos

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
# two levels of a few seconds each, plus Locust's start and the metrics settle time, with room
# for a loaded 2-core machine; a sweep that hangs fails here instead of hanging the suite
SWEEP_BOUND_S = 120


def wait_idle(metrics_url: str) -> None:
    """No request running or waiting, every block free (an earlier test's requests would count in
    the server totals the checks compare with)."""
    gauges = chaos.wait_idle(metrics_url)
    assert chaos.is_idle(gauges), f"the server is still busy: {gauges}"


def run_sweep(tmp_path: Path, label: str, *args: str) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "loadtest.sweep", "--out", str(tmp_path), "--label", label, *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=SWEEP_BOUND_S)
    elapsed = time.monotonic() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[2/2] concurrency" in done.stdout or "[1/1] concurrency" in done.stdout  # progress shown
    return json.loads((tmp_path / f"{label}.json").read_text()), elapsed


def check_levels(result: dict, levels: list[int]) -> None:
    assert [lv["concurrency"] for lv in result["levels"]] == levels
    for lv in result["levels"]:
        where = f"c={lv['concurrency']}"
        run = lv["driver"]
        assert not run["killed"] and run["exit_code"] == 0, (where, run)  # exited on its own
        assert lv["errors"] == 0 and lv["error_rate"] == 0.0, (where, lv["error_samples"])
        assert lv["cancelled"] == 0, where  # the stop timeout let every in-flight request finish
        assert lv["requests"] > 0 and lv["request_per_s"] > 0 and lv["output_tok_per_s"] > 0, where
        records = lv["records"]
        assert len(records) == lv["requests"]
        for r in records:
            assert r["ok"] and r["ttft_ms"] is not None, r
            assert 0 < r["ttft_ms"] <= r["e2e_ms"], r
            # counted here (token-carrying deltas) == what the server said == what was asked for
            assert r["output_tokens"] == r["server_num_output_tokens"] == r["max_tokens"], r
            assert r["finish_reason"] == "length", r
            assert r["num_input_tokens"] == r["prompt_tokens"], r  # token-exact prompts
        # the server's own counters over the level agree with the records
        server = lv["server"]
        assert server is not None, where
        assert server["requests_finished"] == server["requests_finished/length"] == len(records), (where, server)
        assert server["generation_tokens"] == sum(r["server_num_output_tokens"] for r in records), where
        assert server["prompt_tokens"] == sum(r["prompt_tokens"] for r in records), where
        assert lv["ttft_ms"]["p50"] <= lv["e2e_ms"]["p50"]
        assert lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p90"] <= lv["ttft_ms"]["p99"]


def test_grpc_agentic_sweep(triton_server, tmp_path):
    wait_idle(triton_server.metrics_url)
    result, elapsed = run_sweep(
        tmp_path, "grpc", "--url", triton_server.grpc_url, "--metrics-url", triton_server.metrics_url,
        "--concurrency", "1,4", "--duration", "4s", "--stop-timeout", "30s", "--workload", "agentic",
        "--system-len", "48", "--turn-len", "16", "--output-len", "6:10", "--turns", "3")
    check_levels(result, [1, 4])
    assert elapsed < SWEEP_BOUND_S
    for lv in result["levels"]:
        # turns after the first share the system prompt and the conversation: the server hit its cache
        assert lv["server"]["prefix_hit_ratio"] > 0.3, lv["server"]
        assert lv["server"]["deltas_per_response"] >= 1 and 0 < lv["server"]["response_thread_busy"] < 1
        assert any(r["turn"] > 1 for r in lv["records"])
    # Locust's own stats carry one row per metric
    with open(tmp_path / "raw" / "grpc" / "c4" / "locust_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert {"TTFT", "ITL", "E2E"} <= set(rows)
    assert int(rows["E2E"]["Request Count"]) == result["levels"][1]["requests"]
    assert int(rows["E2E"]["Failure Count"]) == 0
    csv_rows = list(csv.DictReader(open(tmp_path / "grpc.csv")))
    assert [int(r["concurrency"]) for r in csv_rows] == [1, 4] and float(csv_rows[1]["output_tok_per_s"]) > 0


def test_http_random_sweep(triton_server, tmp_path):
    wait_idle(triton_server.metrics_url)
    result, elapsed = run_sweep(
        tmp_path, "http", "--protocol", "http", "--url", triton_server.http_url,
        "--metrics-url", triton_server.metrics_url, "--concurrency", "1,4", "--duration", "4s",
        "--stop-timeout", "30s", "--workload", "random", "--input-len", "24:40", "--output-len", "4:12")
    check_levels(result, [1, 4])
    assert elapsed < SWEEP_BOUND_S
    assert result["levels"][1]["request_per_s"] > result["levels"][0]["request_per_s"]  # batching works


def test_users_cancelled_at_stop_still_exit(triton_server, tmp_path):
    """No stop timeout: Locust kills users mid-stream. The streams are cancelled, the process exits
    by itself (the sweep would have to kill it otherwise: `killed`)."""
    wait_idle(triton_server.metrics_url)
    result, _ = run_sweep(
        tmp_path, "cancel", "--url", triton_server.grpc_url, "--metrics-url", triton_server.metrics_url,
        "--concurrency", "12", "--duration", "3s", "--stop-timeout", "0", "--input-len", "16",
        "--output-len", "400")
    (lv,) = result["levels"]
    assert not lv["driver"]["killed"] and lv["driver"]["exit_code"] == 0
    assert lv["driver"]["elapsed_s"] < 30
    assert lv["errors"] == 0 and lv["cancelled"] == 12  # every user was mid-request
    assert all(r["output_tokens"] < r["max_tokens"] for r in lv["records"] if r["cancelled"])
    assert lv["output_tok_per_s"] > 0
    wait_idle(triton_server.metrics_url)  # the server aborted them: nothing is left running


def test_thread_users_abandoned_at_the_stop_are_recorded_cancelled(triton_server, tmp_path):
    """The thread driver: requests that outlive the window and the stop timeout are recorded as
    cancelled with what they streamed (as Locust's users stopped mid-stream are), so the level
    counts their tokens instead of reporting that none came."""
    wait_idle(triton_server.metrics_url)
    result, _ = run_sweep(
        tmp_path, "abandon", "--driver", "threads", "--url", triton_server.grpc_url,
        "--metrics-url", triton_server.metrics_url, "--concurrency", "2", "--duration", "2s", "--stop-timeout", "1s",
        "--input-len", "16", "--output-len", "400")
    (lv,) = result["levels"]
    assert lv["failure"] is None and lv["driver"]["exit_code"] == 0
    assert lv["requests"] == 0 and lv["errors"] == 0 and lv["cancelled"] == 2  # both users mid-request
    cancelled = [r for r in lv["records"] if r["cancelled"]]
    assert all(0 < r["output_tokens"] < r["max_tokens"] and r["ttft_ms"] is not None for r in cancelled)
    assert lv["output_tok_per_s"] > 0
    wait_idle(triton_server.metrics_url)  # the streams were dropped with the driver: the server aborted them
