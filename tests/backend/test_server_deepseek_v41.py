"""DeepSeek-V4.1 through a real tritonserver: the oracle checkpoint streamed over gRPC and HTTP
equals the same engine offline."""

from __future__ import annotations

import pytest

from client.grpc import GrpcClient
from client.http import HttpClient
from engine.llm import LLM
from engine.request import SamplingParams
from tests.engine.models.deepseek_v41.oracle import ORACLE, needs_oracle

pytestmark = [pytest.mark.slow, needs_oracle]
ARGS = {"max_model_len": 256, "max_num_seqs": 4, "dtype": "float32"}
PROMPTS = ["The quick brown fox", "Engram tables hash n-grams"]


@pytest.fixture(scope="module")
def server():
    from backend.serve import TritonServer

    with TritonServer(model=str(ORACLE), engine_args=ARGS, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=300) as s:
        yield s


def test_streamed_greedy_text_equals_the_engine_offline(server):
    llm = LLM(str(ORACLE), **ARGS)
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    with GrpcClient(server.grpc_url) as grpc:
        for prompt, text in zip(PROMPTS, want):
            deltas = list(grpc.generate_stream(prompt, max_tokens=16, temperature=0, ignore_eos=True))
            assert len(deltas) >= 2 and deltas[-1].finish_reason == "length"
            assert "".join(d.text for d in deltas) == text
    http = HttpClient(server.http_url)
    assert "".join(d.text for d in http.generate_stream(PROMPTS[0], max_tokens=16, temperature=0,
                                                         ignore_eos=True)) == want[0]
