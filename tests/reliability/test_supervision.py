"""The launcher against a tritonserver that dies: one crafted HTTP body (deeply nested JSON) makes
Triton 2.51's parser overflow its stack (SIGSEGV). The launcher removes everything of the dead
server (its python stubs outlive it otherwise, re-parented and holding their memory, and its
shared-memory regions stay in /dev/shm), says why, starts it again and serves; with --no-restart it
exits 1 instead. Killing the launcher with SIGKILL leaves nothing behind either."""

from __future__ import annotations

import http.client
import os
import signal
import stat
import time
import urllib.request
from pathlib import Path

import pytest

from backend import workdir
from backend.process_tree import alive, descendants, free_port
from tests.reliability.conftest import http_generate
from tests.reliability.launcher import Launcher

pytestmark = pytest.mark.slow

NESTED_BODY = '{"text_input":"hi","x":' + "[" * 300_000 + "]" * 300_000 + "}"


def _eventually(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def _gone(pids: list[int], timeout_s: float) -> bool:
    return _eventually(lambda: not any(alive(pid) for pid in pids), timeout_s)


def _generates(http_url: str) -> bool:
    status, payload = http_generate(http_url, {"text_input": "still here", "parameters": {"max_tokens": 4}})
    return status == 200 and "text_output" in payload


def _crash(launcher: Launcher) -> None:
    host, port = launcher.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v2/models/deepseek_v4/generate", body=NESTED_BODY,
                     headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    except OSError:
        pass  # the server died under the request
    finally:
        conn.close()


def test_a_crashed_server_and_a_killed_openai_front_are_cleaned_up_and_restarted(tmp_path):
    """One launcher with the OpenAI front (one start, not one per failure): tritonserver crashes, then
    the front is killed; each is cleaned up, logged and started again, and SIGTERM then stops everything."""
    port = free_port()
    launcher = Launcher(tmp_path, "--openai-port", str(port))
    try:
        launcher.wait_ready()
        first = launcher.server_pids()
        regions = launcher.server_regions()
        assert len(first) >= 2 and regions, (first, regions)  # tritonserver + its stub
        # the regions carry prompt text: in a /dev/shm of the server's own (0700), else 0600
        assert all(stat.S_IMODE(r.parent.stat().st_mode) == 0o700 or stat.S_IMODE(r.stat().st_mode) & 0o077 == 0
                   for r in regions), [oct(r.stat().st_mode) for r in regions]

        _crash(launcher)
        assert _gone(first, 30), f"left behind after the crash: {[p for p in first if alive(p)]}\n{launcher.tail()}"
        assert _eventually(lambda: not any(r.exists() for r in regions), 10), regions
        launcher.wait_ready()
        assert _generates(launcher.http_url)
        log = launcher.log()
        assert "tritonserver died (killed by SIGSEGV)" in log and "restarting tritonserver" in log, log[-4000:]
        assert set(launcher.server_pids()).isdisjoint(first)

        front = _openai_front(launcher)
        assert len(front) == 1, launcher.tail()
        restarts = launcher.log().count("the OpenAI API restarted")
        os.kill(front[0], signal.SIGKILL)
        assert _eventually(lambda: launcher.log().count("the OpenAI API restarted") > restarts, 90), launcher.tail()
        assert "the OpenAI API died (killed by SIGKILL)" in launcher.log(), launcher.tail()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
            assert response.status == 200

        second = launcher.server_pids()
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.wait_exit(60) == 0, launcher.tail()
        assert _gone(second, 10) and not launcher.regions(), (launcher.server_pids(), launcher.regions())
    finally:
        launcher.close()


def _openai_front(launcher: Launcher) -> list[int]:
    return [pid for pid in descendants(launcher.process.pid)
            if b"backend.openai" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_no_restart_exits_1_and_leaves_nothing(tmp_path):
    launcher = Launcher(tmp_path, "--no-restart")
    try:
        launcher.wait_ready()
        pids = launcher.server_pids()
        _crash(launcher)
        assert launcher.wait_exit(60) == 1, launcher.tail()
        assert "not restarting: --no-restart" in launcher.tail()
        assert _gone(pids, 5) and not launcher.regions(), (launcher.server_pids(), launcher.regions())
    finally:
        launcher.close()


def test_sigkill_of_the_launcher_leaves_no_server(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        launcher.wait_ready()
        pids = launcher.server_pids()
        os.kill(launcher.process.pid, signal.SIGKILL)
        launcher.process.wait()
        # tritonserver gets SIGTERM when the launcher dies and stops its stub; a stub whose server
        # is gone ends itself (backend/model.py)
        assert _gone(pids, 30), [p for p in pids if alive(p)]
        # the admin key it left is this user's alone, and the next start on the dir sweeps it
        key = tmp_path / workdir.ADMIN_KEY_FILE
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        workdir.claim(tmp_path)
        assert not key.exists() and (tmp_path / "tritonserver.log").exists()
    finally:
        launcher.close()
