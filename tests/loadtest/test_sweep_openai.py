"""`python -m loadtest.sweep --protocol openai`: Locust's OpenAIUser against the OpenAI service
(streamed /v1/completions) in front of the session's tritonserver; the same checks as the
Triton users' sweeps (test_sweep.py)."""

from __future__ import annotations

import pytest

from tests.loadtest.test_sweep import SWEEP_BOUND_S, check_levels, run_sweep, wait_idle

pytestmark = pytest.mark.slow


def test_openai_random_sweep(triton_server, openai_server, tmp_path):
    wait_idle(triton_server.metrics_url)
    url = openai_server.base_url.removeprefix("http://").removesuffix("/v1")
    result, elapsed = run_sweep(
        tmp_path, "openai", "--protocol", "openai", "--url", url, "--metrics-url", triton_server.metrics_url,
        "--concurrency", "2", "--duration", "4s", "--stop-timeout", "30s", "--workload", "random",
        "--input-len", "24:40", "--output-len", "4:12")
    check_levels(result, [2])
    assert elapsed < SWEEP_BOUND_S


def test_openai_random_sweep_from_threads(triton_server, openai_server, tmp_path):
    """The thread driver's OpenAI client (loadtest/openai_stream.py) over two worker processes."""
    wait_idle(triton_server.metrics_url)
    url = openai_server.base_url.removeprefix("http://").removesuffix("/v1")
    result, _ = run_sweep(
        tmp_path, "openai-threads", "--protocol", "openai", "--driver", "threads", "--client-processes", "2",
        "--url", url, "--metrics-url", triton_server.metrics_url, "--concurrency", "4", "--duration", "4s",
        "--stop-timeout", "30s", "--workload", "random", "--input-len", "24:40", "--output-len", "4:12")
    check_levels(result, [4])
    assert len(result["levels"][0]["saturation"]["client_cpu"]["per_process"]) == 2
