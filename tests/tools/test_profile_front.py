"""tools.profile_front against the shared tritonserver and OpenAI front: both legs stream every token
asked for, and the front's CPU is read only where the front did the work."""

from __future__ import annotations

import pytest

from tools import profile_front

pytestmark = pytest.mark.slow


def test_legs_count_tokens_and_the_fronts_cpu(triton_server, openai_server):
    # 512 tokens a leg (~0.2 s of the front's CPU through it): its work then stands well above the CPU clock's
    # 10 ms ticks and its background polls (readiness, metrics), which 48 tokens (~0.01 s) did not
    through = profile_front.leg("openai", triton_server, openai_server, users=4, requests=2, max_tokens=64)
    assert through["error_count"] == 0 and through["output_tokens"] == 512
    assert through["front_cpu_s"] > 0 and through["front_us_per_token"] > 0
    direct = profile_front.leg("triton", triton_server, openai_server, users=4, requests=2, max_tokens=64)
    assert direct["error_count"] == 0 and direct["output_tokens"] == 512
    assert direct["front_cpu_s"] < through["front_cpu_s"]  # the front is idle while Triton is called directly
