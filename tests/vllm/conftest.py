"""Fixtures for the vLLM engine: a tiny Llama checkpoint (vLLM's CPU backend runs Llama natively;
DeepSeek-V4 it cannot here: docs/VLLM.md) and a real tritonserver serving it with "engine": "vllm"."""

from __future__ import annotations

import pytest

from tests.vllm import VLLM_CPU_ARGS

# The repository's own model.json (every key in it is also a vLLM engine argument) with the engine
# switched and the CPU settings; sizes as tests/conftest.py's native server.
SERVER_ENGINE_ARGS = {**VLLM_CPU_ARGS, "max_model_len": 512, "max_num_seqs": 16}


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory):
    from tools.make_tiny_vllm_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def triton_server(vllm_checkpoint):
    """Overrides tests/conftest.py's native server for the tests under tests/vllm/."""
    from backend.serve import TritonServer

    with TritonServer(model=str(vllm_checkpoint), engine_args=SERVER_ENGINE_ARGS, http_port=0, grpc_port=0,
                      metrics_port=0, startup_timeout_s=300) as server:
        yield server
