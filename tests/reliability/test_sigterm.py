"""Graceful shutdown of `python -m backend.serve`: SIGTERM stops admission at once, the requests
in flight finish (up to --drain-timeout-s), one that would outlive the timeout is cut off (an
error, not a hang), requests still queued end at once, and the launcher exits 0 with no server
left behind."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from backend.process_tree import alive
from loadtest.chaos import GrpcCall, engine_gauges, good_tensors
from tests.reliability.conftest import http_generate
from tests.reliability.launcher import Launcher

pytestmark = pytest.mark.slow


def _streams(launcher: Launcher, max_tokens: list[int], timeout_s: float) -> tuple[list[threading.Thread], dict]:
    """One streaming request per entry, each in a thread: results[i] = (outcome, message, responses, done at)."""
    results: dict = {}

    def stream(i: int):
        call = GrpcCall(launcher.grpc_url)
        try:
            outcome, message, responses, _ = call.run(
                good_tensors(f"draining {i}", {"max_tokens": max_tokens[i], "ignore_eos": True}), timeout_s=timeout_s)
            results[i] = (outcome, message, responses, time.monotonic())
        finally:
            call.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(max_tokens))]
    for t in threads:
        t.start()
    return threads, results


def _wait_gauges(launcher: Launcher, ok, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok(engine_gauges(launcher.metrics_url)):
        assert time.monotonic() < deadline, launcher.tail()
        time.sleep(0.1)


def _sigterm(launcher: Launcher, threads: list[threading.Thread], drain_s: int) -> tuple[int, float, float]:
    """SIGTERM, then wait for the clients and the launcher: (exit code, sent at, seconds to exit)."""
    sigterm_at = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=drain_s + 90)
    code = launcher.process.wait(timeout=drain_s + 60)
    return code, sigterm_at, time.monotonic() - sigterm_at


def test_sigterm_stops_admission_and_drains_in_flight_requests(tmp_path):
    drain_s = 20
    launcher = Launcher(tmp_path, engine_args={"max_model_len": 4096, "max_num_seqs": 8}, drain_s=drain_s)
    try:
        launcher.wait_ready()
        pids = launcher.server_pids()
        # three short requests that finish within the drain timeout, one that cannot
        threads, results = _streams(launcher, [60, 60, 60, 4000], timeout_s=drain_s + 60)
        _wait_gauges(launcher, lambda g: g["running"] == 4)
        sigterm_at = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        # admission stopped: HTTP refuses connections, gRPC refuses the model
        with pytest.raises(OSError):
            http_generate(launcher.http_url, {"text_input": "too late", "parameters": {"max_tokens": 4}}, timeout_s=10)
        call = GrpcCall(launcher.grpc_url)
        try:
            outcome, message, _, _ = call.run(good_tensors("too late", {"max_tokens": 4}), timeout_s=10)
        finally:
            call.close()
        assert outcome == "error", message
        for t in threads:
            t.join(timeout=drain_s + 90)
        code = launcher.process.wait(timeout=drain_s + 60)
        exited_after = time.monotonic() - sigterm_at
    finally:
        launcher.close()
    log = launcher.log()
    for i in range(3):  # drained: the whole answer
        outcome, message, responses, _ = results[i]
        assert outcome == "completed", (message, log[-3000:])
        assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == 60
    outcome, message, _, _ = results[3]  # cut off at the drain timeout, and told so
    assert outcome == "error" and "drain timeout" in message, (outcome, message)
    assert code == 0, log[-3000:]
    assert exited_after < drain_s + 20, exited_after
    assert not any(alive(pid) for pid in pids) and not launcher.regions()


def test_sigterm_after_a_burst_ends_queued_requests_and_exits_before_the_timeout(tmp_path):
    """Triton tells a decoupled model nothing until finalize, which waits for every open stream:
    with a queue behind a burst the server used to wait the whole timeout, then exit
    non-gracefully ("Exit timeout expired", a crash on the way out). The launcher now tells the
    model the deadline: queued requests end UNAVAILABLE at once, running ones at the deadline,
    finalize runs and Triton exits on its own."""
    drain_s = 12
    launcher = Launcher(tmp_path, engine_args={"max_model_len": 4096, "max_num_seqs": 2, "max_waiting_requests": 200},
                        drain_s=drain_s)
    try:
        launcher.wait_ready()
        threads, results = _streams(launcher, [4000] * 40, timeout_s=drain_s + 60)
        # every stream in the engine before the signal: one still on its way would meet an unloading model instead
        _wait_gauges(launcher, lambda g: g["running"] == 2 and g["waiting"] == 38)
        code, sigterm_at, exited_after = _sigterm(launcher, threads, drain_s)
    finally:
        launcher.close()
    log = launcher.server_log()
    assert code == 0, (code, launcher.tail())
    assert "finalize: done" in log and "Exit timeout expired" not in log, launcher.tail()
    assert exited_after < drain_s + 5, exited_after
    assert len(results) == 40 and all(r[0] == "error" for r in results.values()), results
    queued = [r for r in results.values() if "had not started" in r[1]]
    cut_off = [r for r in results.values() if "drain timeout" in r[1]]
    assert len(cut_off) == 2 and len(queued) == 38, results  # the two running ones ran to the deadline
    assert all(m.startswith("UNAVAILABLE") and at - sigterm_at < drain_s / 2 for _, m, _, at in queued), queued
    assert all(m.startswith("UNAVAILABLE") and at - sigterm_at > drain_s / 2 for _, m, _, at in cut_off), cut_off
