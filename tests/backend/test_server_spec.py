"""Speculative decoding behind a real tritonserver: greedy text equal to the engine without it,
vLLM's spec_decode families on the metrics port, a sampled request alongside."""

import time

import pytest
import torch

from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import SamplingParams
from loadtest.scrape import metric, metrics_text
from tests.backend.test_server import raw_generate

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("spec") / "tiny", "tiny", seed=0)  # with mtp.0.*


def test_speculative_server_streams_the_plain_engines_tokens_and_reports_acceptance(checkpoint):
    from backend.serve import TritonServer

    want = LLM(str(checkpoint), dtype="float32", max_model_len=256).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    args = {"model": str(checkpoint), "dtype": "float32", "max_model_len": 256, "max_num_seqs": 8,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    with TritonServer(engine_args=args, http_port=0, grpc_port=0, metrics_port=0, startup_timeout_s=300) as server:
        status, out = raw_generate(server, {"text_input": PROMPT, "exclude_input_in_output": True,
                                            "sampling_parameters": '{"max_tokens": 24, "temperature": 0, '
                                                                   '"ignore_eos": true}'})
        assert status == 200, out
        assert out["text_output"] == want
        status, out = raw_generate(server, {"text_input": PROMPT, "sampling_parameters":
                                            '{"max_tokens": 8, "temperature": 0.8, "top_k": 5, "ignore_eos": true}'})
        assert status == 200, out
        time.sleep(1.2)  # the metrics thread polls engine stats every 0.5 s
        text = metrics_text(server.metrics_url)
        drafts = metric(text, "deepseek:spec_decode_num_drafts_total")
        tokens = metric(text, "deepseek:spec_decode_num_draft_tokens_total")
        accepted = metric(text, "deepseek:spec_decode_num_accepted_tokens_total")
        assert drafts >= 10 and tokens >= drafts and 0 <= accepted <= tokens
        assert metric(text, "deepseek:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        rate = metric(text, "deepseek:spec_decode_draft_acceptance_rate")
        assert rate == pytest.approx(accepted / tokens)
        assert metric(text, "deepseek:spec_decode_mean_acceptance_length") == pytest.approx(1 + accepted / drafts)
        assert torch.isfinite(torch.tensor(rate))
