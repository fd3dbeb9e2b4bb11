"""A sweep that measured nothing says so: zero completed requests is a FAILED row and a non-zero
exit, and a load driver that cannot start (seen on the H200: tritonclient without python-rapidjson)
shows its own error instead of `0 req | err 0.0%`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from backend.serve import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def _sweep(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "loadtest.sweep", "--out", str(tmp_path), "--label", "t", "--driver", "threads",
           "--concurrency", "1,2", "--duration", "2", "--stop-timeout", "2", "--metrics-url", "none", *args]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    return done, json.loads((tmp_path / "t.json").read_text())


def test_no_completed_request_is_a_failed_level_and_exit_1(tmp_path):
    done, result = _sweep(tmp_path, "--url", f"127.0.0.1:{free_port()}")  # nothing listens there
    assert done.returncode == 1, done.stdout + done.stderr
    assert all(lv["requests"] == 0 and lv["failure"].startswith("no request completed and no token came") for lv in result["levels"])
    assert done.stdout.count("FAILED: no request completed and no token came") == 2, done.stdout
    assert "measured nothing" in done.stdout


def test_a_driver_that_cannot_start_shows_its_error(tmp_path):
    broken = tmp_path / "site"
    (broken / "tritonclient").mkdir(parents=True)
    (broken / "tritonclient" / "__init__.py").write_text("raise ImportError(\"No module named 'rapidjson'\")\n")
    pythonpath = os.pathsep.join([str(broken), str(REPO_ROOT)])
    done, result = _sweep(tmp_path / "out", "--url", "127.0.0.1:1", env={"PYTHONPATH": pythonpath})
    assert done.returncode == 1, done.stdout + done.stderr
    failure = result["levels"][0]["failure"]
    assert "the load driver exited with code" in failure and "rapidjson" in failure, failure
