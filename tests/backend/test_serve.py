"""backend/serve.py: repository preparation, the command line it builds, and the CLI end to end."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from backend.serve import (
    REPO_ROOT,
    TritonServer,
    find_tritonserver,
    free_port,
    layout_backends,
    prepare_repository,
    server_flags,
)


def write_repo(root):
    (root / "ckpt").mkdir(parents=True)
    version = root / "repo" / "deepseek_v4" / "1"
    version.mkdir(parents=True)
    (version / "model.json").write_text(json.dumps({"engine": "native", "model": "../../../ckpt", "seed": 0}))
    (root / "repo" / "deepseek_v4" / "config.pbtxt").write_text('backend: "deepseek"\n')
    return root / "repo"


def test_prepare_repository_keeps_paths_valid_and_applies_overrides(tmp_path):
    src = write_repo(tmp_path)
    out = prepare_repository(src, tmp_path / "copy")
    args = json.loads((out / "deepseek_v4" / "1" / "model.json").read_text())
    assert args["model"] == str((tmp_path / "ckpt").resolve())  # relative to the original
    out = prepare_repository(src, tmp_path / "copy2", model="tiny", engine_args={"max_model_len": 99})
    args = json.loads((out / "deepseek_v4" / "1" / "model.json").read_text())
    assert args["model"] == "tiny" and args["max_model_len"] == 99 and args["seed"] == 0
    assert json.loads((src / "deepseek_v4" / "1" / "model.json").read_text())["model"] == "../../../ckpt"


def test_backends_layout_has_the_stub_and_our_backend(tmp_path):
    install = find_tritonserver()
    out = layout_backends(install, tmp_path / "backends")
    assert (out / "python" / "libtriton_python.so").is_file()
    assert (out / "python" / "triton_python_backend_stub").is_file()
    assert "from backend.model import TritonPythonModel" in (out / "deepseek" / "model.py").read_text()
    # the model checks numpy against the stub's Triton version, read from here (as in NVIDIA's images)
    assert (out / "TRITON_VERSION").read_text().strip() == "2.51"


def test_command_binds_loopback_and_restricts_admin_apis(tmp_path):
    server = TritonServer(workdir=tmp_path, admin_key="k3y", http_port=0, grpc_port=0, metrics_port=0)
    command = server.command(find_tritonserver())
    assert "--http-address=127.0.0.1" in command and "--grpc-address=127.0.0.1" in command
    assert "--metrics-address=127.0.0.1" in command
    restricted = "shared-memory,logging,trace:admin-key=k3y"
    assert f"--http-restricted-api={restricted}" in command
    assert f"--grpc-restricted-protocol={restricted}" in command
    # model control (a load with override files runs code) is shut: its key is nobody's
    control = [arg for arg in command if arg.startswith("--http-restricted-api=model-repository:admin-key=")]
    assert len(control) == 1 and not control[0].endswith("=k3y")
    opened = TritonServer(workdir=tmp_path, admin_key="k3y", http_port=0, grpc_port=0, metrics_port=0,
                          allow_model_control=True).command(find_tritonserver())
    assert "--http-restricted-api=model-repository:admin-key=k3y" in opened
    assert "--grpc-restricted-protocol=model-repository:admin-key=k3y" in opened
    assert any(arg.startswith("--backend-config=python,shm-default-byte-size=") for arg in command)
    assert len({server.http_port, server.grpc_port, server.metrics_port}) == 3


def serve_cli(*args):
    return subprocess.Popen([sys.executable, "-m", "backend.serve", "--http-port", str(free_port()),
                             "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), *args],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_cli_starts_prints_usage_and_stops_on_ctrl_c():
    process = serve_cli("--engine-args", '{"max_model_len": 256}')
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C stops the server" in line:
                break
        assert any("curl -s http://127.0.0.1:" in line for line in lines), "".join(lines[-30:])
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert any("stopping tritonserver" in line for line in process.stdout)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_cli_fails_clearly_when_the_model_cannot_load():
    process = serve_cli("--engine-args", '{"engine": "bogus"}')
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 1
    headline = re.search(r"^error: (?!creating server).*", out, re.M).group(0)  # not Triton's own, echoed
    assert "unknown engine 'bogus'" in headline, out
    assert "tritonserver exited with code 1 before it was ready; work dir kept:" in out
    shutil.rmtree(re.search(r"work dir kept: (\S+),", out).group(1), ignore_errors=True)


def test_flags_follow_the_servers_own_help(tmp_path):
    """Triton 2.51 has no --http-max-input-size (newer releases do): pass it only where it exists."""
    install = find_tritonserver()
    server = TritonServer(workdir=tmp_path, http_port=0, grpc_port=0, metrics_port=0)
    flags = server_flags(install, server.environment(install))
    assert {"--exit-timeout-secs", "--http-restricted-api", "--backend-config"} <= flags
    has_limit = "--http-max-input-size" in flags
    assert any(arg.startswith("--http-max-input-size=") for arg in server.command(install)) == has_limit


def test_the_banners_client_command_runs_as_printed(tmp_path):
    """`python -m client` outside the venv is ModuleNotFoundError: tritonclient; the banner names
    this interpreter as the user can type it from here."""
    usage = TritonServer(workdir=tmp_path, http_port=0, grpc_port=0, metrics_port=0).usage("x")
    line = next(line for line in usage.splitlines() if "-m client" in line)
    command = line.split()[0]
    assert command != "python" and os.access(command, os.X_OK), line
    done = subprocess.run([command, "-m", "client", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_banners_openai_command_runs_as_printed(tmp_path, openai_server):
    usage = TritonServer(workdir=tmp_path, http_port=0, grpc_port=0, metrics_port=0).usage("x", openai_server.base_url)
    line = next(line for line in usage.splitlines() if "/completions" in line)
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    completion = json.loads(done.stdout)
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] > 0, completion
    keyed = TritonServer(workdir=tmp_path, http_port=0, grpc_port=0, metrics_port=0).usage(
        "x", openai_server.base_url, openai_key=True)
    assert "Authorization: Bearer KEY" in keyed


def test_keys_come_from_option_file_or_environment_never_only_the_command_line(tmp_path, monkeypatch):
    from backend.serve import OPENAI_API_KEY_ENV, read_key

    secret = tmp_path / "key"
    secret.write_text("from-file\n")
    monkeypatch.setenv(OPENAI_API_KEY_ENV, "from-env")
    assert read_key("given", str(secret), OPENAI_API_KEY_ENV) == "given"
    assert read_key(None, str(secret), OPENAI_API_KEY_ENV) == "from-file"  # --openai-api-key-file: not in ps
    assert read_key(None, None, OPENAI_API_KEY_ENV) == "from-env"
    monkeypatch.delenv(OPENAI_API_KEY_ENV)
    assert read_key(None, None, OPENAI_API_KEY_ENV) is None
