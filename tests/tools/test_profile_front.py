"""tools.profile_front against the shared tritonserver and OpenAI front: both legs stream every token
asked for, and the front's CPU is read only where the front did the work."""

from __future__ import annotations

import pytest

from tools import profile_front

pytestmark = pytest.mark.slow


def test_legs_count_tokens_and_the_fronts_cpu(triton_server, openai_server):
    # 24 tokens a stream: the front's work then stands well above its background polls (readiness, metrics)
    through = profile_front.leg("openai", triton_server, openai_server, users=2, requests=1, max_tokens=24)
    assert through["error_count"] == 0 and through["output_tokens"] == 48
    assert through["front_cpu_s"] > 0 and through["front_us_per_token"] > 0
    direct = profile_front.leg("triton", triton_server, openai_server, users=2, requests=1, max_tokens=24)
    assert direct["error_count"] == 0 and direct["output_tokens"] == 48
    assert direct["front_cpu_s"] < through["front_cpu_s"]  # the front is idle while Triton is called directly
