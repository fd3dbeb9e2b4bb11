"""`python -m client` against the session's real server."""

import subprocess
import sys

import pytest

from backend.serve import REPO_ROOT

pytestmark = pytest.mark.slow


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_grpc_and_http_give_the_same_greedy_text(triton_server):
    grpc = run_cli("The quick brown fox", "--max-tokens", "6", "--url", triton_server.grpc_url)
    http = run_cli("The quick brown fox", "--max-tokens", "6", "--protocol", "http", "--stream",
                   "--url", triton_server.http_url)
    assert grpc.returncode == 0 and http.returncode == 0, (grpc.stderr, http.stderr)
    assert grpc.stdout.strip() and grpc.stdout == http.stdout
    assert "generated" in grpc.stderr and "finish" in http.stderr


def test_cli_chat_and_errors(triton_server):
    chat = run_cli("Hi", "--chat", "--stream", "--max-tokens", "4", "--url", triton_server.grpc_url)
    assert chat.returncode == 0, chat.stderr
    bad = run_cli("Hi", "--max-tokens", "100000", "--protocol", "http", "--url", triton_server.http_url)
    assert bad.returncode == 1 and "HTTP 400" in bad.stderr and "max_tokens must be between" in bad.stderr
