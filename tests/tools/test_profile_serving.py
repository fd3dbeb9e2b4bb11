"""tools.profile_serving --hops against the shared tritonserver: users spread over several client
processes come back as one level, every timed request of every process joined by its id."""

from __future__ import annotations

import pytest

from tools import profile_serving

pytestmark = pytest.mark.slow


def test_hops_merges_the_client_processes(triton_server, tmp_path):
    r = profile_serving.hops(triton_server, users=3, requests=1, input_len=8, max_tokens=3, model=None,
                             trace_prefix=str(tmp_path / "trace"), processes=2)
    assert r["errors"] == 0 and r["client_processes"] == 2
    assert r["requests"] == 3 and r["output_tokens"] == 9  # 1 timed request of 3 tokens per user
    assert r["totals"]["client TTFT"]["n"] == 3
    assert 0 < r["client_busiest_process_cores"] <= r["client_cpu_cores"]
