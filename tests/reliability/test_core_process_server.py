"""The engine core killed under a real tritonserver: the requests in flight fail UNAVAILABLE, the
model stays loaded while the core restarts (requests meanwhile: UNAVAILABLE, never a hang), then
it serves again from a new core process; when the server stops, no core remains. A hung core turns
the OpenAI front's readiness false within seconds, long before step_timeout_s declares it dead,
while its /v1/models answers on."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from backend.openai.process import OpenAIProcess
from backend.process_tree import alive
from backend.serve import TritonServer
from loadtest.chaos import GrpcCall, error_code, good_tensors
from tests.reliability.conftest import MARKER

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 4, "core_restart_backoff_s": 0.1}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _core_pid(server: TritonServer) -> int:
    """The engine core: the child of the stub (the process that names the server's region) running spawn_main."""
    stubs = [pid for pid in _children(server.process.pid) if alive(pid)]
    for stub in stubs:
        for child in _children(stub):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return child
    raise AssertionError(f"no engine core under the stubs {stubs}")


def _run(server: TritonServer, prompt: str, max_tokens: int, timeout_s: float = 60):
    call = GrpcCall(server.grpc_url)
    try:
        return call.run(good_tensors(prompt, {"max_tokens": max_tokens, "ignore_eos": True}), timeout_s=timeout_s)
    finally:
        call.close()


def await_recovery(server: TritonServer, timeout_s: float = 120) -> None:
    """After a kill: the core restarts; meanwhile requests are refused UNAVAILABLE, never hung."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome, message, _, _ = _run(server, "after the kill", 4)
        if outcome == "completed":
            break
        assert error_code(message) == "UNAVAILABLE" and time.monotonic() < deadline, message
        time.sleep(0.5)
    assert server.models_ready()


def test_a_killed_core_fails_its_requests_and_the_model_serves_again():
    with TritonServer(engine_args=ENGINE_ARGS, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=300) as server:
        assert _run(server, "warm up", 4)[0] == "completed"
        core = _core_pid(server)
        results: dict = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _run(server, f"long {i}", 240)))
                   for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # both decoding
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(timeout=90)
        assert all(r[0] == "error" and error_code(r[1]) == "UNAVAILABLE" for r in results.values()), results
        await_recovery(server)
        new_core = _core_pid(server)
        assert new_core != core and not alive(core)
    assert not alive(new_core)


def _get(front: OpenAIProcess, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{front.port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(front: OpenAIProcess) -> tuple[int, dict]:
    return _get(front, "/health")


def _until_health(front: OpenAIProcess, status: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while (found := _health(front))[0] != status:
        assert time.monotonic() < deadline, f"/health stayed {found} ({timeout_s:g} s)"
        time.sleep(0.2)
    return found[1]


def test_a_hung_core_turns_the_fronts_readiness_false_within_seconds(server):
    """Item 12: the step watchdog needs step_timeout_s (60 s) to declare a hung core dead; the
    front's /health reads how long the step has run (Triton's metrics) and is 503 a few seconds
    in (Triton's own readiness stays 200 meanwhile: its python backend cannot say otherwise). The
    core killed, it restarts and /health is 200 again."""
    with OpenAIProcess(server.grpc_url, port=0, triton_metrics=server.metrics_url,
                       log_path=server.workdir / "openai-readiness.log",
                       extra_args=("--unresponsive-after-s", "1")) as front:  # 5 s by default: 4 s of test saved
        assert _health(front) == (200, {"ready": True})
        result = {}
        hung = threading.Thread(target=lambda: result.setdefault("hung", _run(server, f"{MARKER}:hang", 4)))
        hung.start()
        try:
            # 1 s (the front's bound here) plus the gauge's 0.5 s poll, with room for a loaded machine;
            # well within step_timeout_s (60 s), which readiness used to need
            body = _until_health(front, 503, timeout_s=25)
            assert "unresponsive" in body["reason"], body
            assert server.models_ready()  # Triton's readiness: what a load balancer saw before
            # /health is the readiness signal; the routes that need no engine answer as ever (vLLM's way)
            status, models = _get(front, "/v1/models")
            assert status == 200 and models["data"][0]["id"] == "deepseek_v4", models
        finally:
            os.kill(_core_pid(server), signal.SIGKILL)
            hung.join(timeout=60)
        assert result["hung"][0] == "error" and error_code(result["hung"][1]) == "UNAVAILABLE", result
        await_recovery(server)
        assert _until_health(front, 200, timeout_s=30) == {"ready": True}
