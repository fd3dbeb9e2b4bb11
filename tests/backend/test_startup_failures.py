"""A start that fails says why first: a busy port at once (before anything loads), a model that
cannot load by its own error message (never Triton's harmless GPU-probe lines), and the work dir
with its logs stays for the post-mortem; a work dir whose launcher was SIGKILLed loses its
admin key at the next start."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend import workdir
from backend.serve import REPO_ROOT, free_port
from backend.startup_report import headline

# Lines from a real failed start (a checkpoint path without a tokenizer), in their order.
FAILED_LOAD_LOG = [
    'W1204 17:41:27.686949 31874 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned '
    'memory pool will not be available: CUDA driver version is insufficient for CUDA runtime version"',
    'E1204 17:41:27.687077 31874 server.cc:241] "CudaDriverHelper has not been initialized."',
    'E1204 17:41:47.174924 31874 backend_model.cc:692] "ERROR: Failed to create instance: FileNotFoundError: '
    '/nonexistent/ckpt/tokenizer.json not found (the engine argument \'tokenizer\' may point elsewhere)\\n\\nAt:\\n'
    '  /work/engine/tokenizer.py(18): __init__\\n"',
    "Error: Failed to initialize NVML",
    'W1204 17:41:47.195221 31874 metrics.cc:798] "DCGM unable to start: DCGM initialization error"',
    "error: creating server: Internal - failed to load all models",
]


def test_headline_is_the_models_error_unescaped_not_the_gpu_probes():
    assert headline(FAILED_LOAD_LOG) == ("Failed to create instance: FileNotFoundError: /nonexistent/ckpt/tokenizer.json "
                                         "not found (the engine argument 'tokenizer' may point elsewhere)")
    assert headline(FAILED_LOAD_LOG[:2] + FAILED_LOAD_LOG[3:]) == "creating server: Internal - failed to load all models"


def serve(*args: str, ports: tuple[int, int, int] | None = None) -> subprocess.CompletedProcess:
    http, grpc, metrics = ports or (free_port(), free_port(), free_port())
    return subprocess.run([sys.executable, "-m", "backend.serve", "--http-port", str(http), "--grpc-port", str(grpc),
                           "--metrics-port", str(metrics), *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("which", ["http", "openai"])
def test_a_busy_port_fails_in_under_2_s_naming_the_port_and_its_holder(which):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        if which == "http":
            done = serve(ports=(port, free_port(), free_port()))
        else:
            done = serve("--openai-port", str(port))
        took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < 2.0, took
    purpose = "HTTP" if which == "http" else "OpenAI API"
    assert f"error: port {port} ({purpose}) on 127.0.0.1 is already in use by pid {os.getpid()}" in done.stderr, \
        done.stderr


@pytest.mark.slow
def test_a_model_that_cannot_load_headlines_its_error_and_keeps_the_work_dir():
    done = serve("--model", "/nonexistent/ckpt")
    first_error = next(line for line in done.stderr.splitlines() if line.startswith("error:"))
    assert "tokenizer.json not found" in first_error and "NVML" not in first_error, done.stderr
    kept = Path(re.search(r"work dir kept: (\S+),", done.stderr).group(1))
    try:
        assert (kept / "tritonserver.log").is_file(), done.stderr
        assert not (kept / workdir.ADMIN_KEY_FILE).exists() and not (kept / workdir.OWNER_FILE).exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_the_next_start_sweeps_the_key_of_a_killed_launchers_work_dir(tmp_path):
    gone = subprocess.Popen(["sleep", "30"])
    killed = tmp_path / f"{workdir.PREFIX}killed"
    killed.mkdir(mode=0o700)
    os.chmod(killed, 0o700)
    (killed / workdir.OWNER_FILE).write_text(f"{gone.pid} {workdir._start_time(gone.pid)}\n")
    workdir.write_admin_key(killed, "s3cret")
    (killed / "tritonserver.log").write_text("evidence\n")
    (killed / "backends").mkdir()
    running = tmp_path / f"{workdir.PREFIX}running"
    workdir.claim(running)
    workdir.write_admin_key(running, "in use")

    assert workdir.sweep_stale(tmp_path) == []  # its launcher still runs
    gone.kill()
    gone.wait()
    assert workdir.sweep_stale(tmp_path) == [killed]
    assert sorted(p.name for p in killed.iterdir()) == ["tritonserver.log"]
    assert (running / workdir.ADMIN_KEY_FILE).read_text() == "in use\n"
    assert oct(os.stat(running / workdir.ADMIN_KEY_FILE).st_mode & 0o777) == "0o600"
