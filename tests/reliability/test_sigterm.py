"""Graceful shutdown of `python -m backend.serve`: SIGTERM stops admission at once, the requests
in flight finish (up to --drain-timeout-s), one that would outlive the timeout is cut off (an
error, not a hang), and the launcher exits 0 with no server left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from backend.serve import REPO_ROOT, free_port
from loadtest.chaos import GrpcCall, engine_gauges, good_tensors
from tests.reliability.conftest import http_generate

pytestmark = pytest.mark.slow

DRAIN_S = 20


def _ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/deepseek_v4/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_admission_and_drains_in_flight_requests(tmp_path):
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    http_url, grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "backend.serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--drain-timeout-s", str(DRAIN_S), "--workdir", str(tmp_path),
         "--engine-args", json.dumps({"max_model_len": 4096, "max_num_seqs": 8})],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not _ready(http_url):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.25)
        triton_pid = int(next(p for p in os.listdir("/proc") if p.isdigit() and _is_triton_of(p, http_port)))

        results: dict = {}

        def stream(i: int, max_tokens: int):
            call = GrpcCall(grpc_url)
            try:
                results[i] = call.run(good_tensors(f"draining {i}", {"max_tokens": max_tokens, "ignore_eos": True}),
                                      timeout_s=DRAIN_S + 60)
            finally:
                call.close()

        # three short requests that finish within the drain timeout, one that cannot
        threads = [threading.Thread(target=stream, args=(i, 60 if i < 3 else 4000)) for i in range(4)]
        for t in threads:
            t.start()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        while engine_gauges(metrics_url)["running"] != 4:
            assert time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.1)
        sigterm_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        # admission stopped: HTTP refuses connections, gRPC refuses the model
        with pytest.raises(OSError):
            http_generate(http_url, {"text_input": "too late", "parameters": {"max_tokens": 4}}, timeout_s=10)
        call = GrpcCall(grpc_url)
        try:
            outcome, message, _, _ = call.run(good_tensors("too late", {"max_tokens": 4}), timeout_s=10)
        finally:
            call.close()
        assert outcome == "error", message

        for t in threads:
            t.join(timeout=DRAIN_S + 90)
        code = launcher.wait(timeout=DRAIN_S + 60)
        exited_after = time.monotonic() - sigterm_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log = "".join(output)
    for i in range(3):  # drained: the whole answer
        outcome, message, responses, _ = results[i]
        assert outcome == "completed", (message, log[-3000:])
        assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 60
    outcome, message, _, _ = results[3]  # cut off at the drain timeout, and told so
    assert outcome == "error", (outcome, message)
    assert code == 0, log[-3000:]
    assert exited_after < DRAIN_S + 20, exited_after
    assert not _alive(triton_pid)


def _is_triton_of(pid: str, http_port: int) -> bool:
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].endswith(b"tritonserver") and f"--http-port={http_port}".encode() in cmdline


def test_sigterm_after_a_burst_ends_queued_requests_and_exits_before_the_timeout(tmp_path):
    """Triton tells a decoupled model nothing until finalize, which waits for every open stream:
    with a queue behind a burst the server used to wait the whole timeout, then exit
    non-gracefully ("Exit timeout expired", a crash on the way out). The launcher now tells the
    model the deadline: queued requests end UNAVAILABLE at once, running ones at the deadline,
    finalize runs and Triton exits on its own."""
    drain_s = 10
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    http_url, grpc_url = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "backend.serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port), "--drain-timeout-s", str(drain_s), "--workdir", str(tmp_path),
         "--engine-args", json.dumps({"max_model_len": 4096, "max_num_seqs": 2, "max_waiting_requests": 200})],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True).start()
    results: dict = {}
    try:
        deadline = time.monotonic() + 300
        while not _ready(http_url):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.25)

        def stream(i: int):
            call = GrpcCall(grpc_url)
            try:
                outcome, message, _, _ = call.run(good_tensors(f"burst {i}", {"max_tokens": 4000, "ignore_eos": True}),
                                                  timeout_s=drain_s + 60)
                results[i] = (outcome, message, time.monotonic())
            finally:
                call.close()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        while not (engine_gauges(metrics_url)["running"] == 2 and engine_gauges(metrics_url)["waiting"] >= 30):
            assert time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.1)
        sigterm_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=drain_s + 90)
        code = launcher.wait(timeout=drain_s + 60)
        exited_after = time.monotonic() - sigterm_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    assert code == 0, "".join(output)[-3000:]
    assert "finalize: done" in log and "Exit timeout expired" not in log, log[-3000:]
    assert exited_after < drain_s + 5, exited_after
    assert len(results) == 40 and all(outcome == "error" for outcome, _, _ in results.values()), results
    queued = [r for r in results.values() if "drain timeout" not in r[1]]
    cut_off = [r for r in results.values() if "drain timeout" in r[1]]
    assert len(cut_off) == 2 and len(queued) == 38, results  # the two running ones ran to the deadline
    assert all(m.startswith("UNAVAILABLE") and at - sigterm_at < 3 for _, m, at in queued), queued
    assert all(m.startswith("UNAVAILABLE") and at - sigterm_at > drain_s / 2 for _, m, at in cut_off), cut_off
