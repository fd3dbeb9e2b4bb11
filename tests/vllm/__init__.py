"""Tests of the vLLM engine (backend/vllm_engine.py). They need vLLM importable in the Python that
runs pytest (`make setup-vllm`, then `make test ENGINE=vllm`); elsewhere they are skipped."""

from __future__ import annotations

import importlib.util

import pytest

SKIP_REASON = "vLLM is not installed in this environment (make setup-vllm; make test ENGINE=vllm)"
# every test module here starts with `pytestmark = needs_vllm` (plus slow where an engine starts)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=SKIP_REASON)

# What vLLM's CPU backend needs here on top of model.json: block sizes in multiples of 32, a small
# fixed KV budget instead of a share of the host's memory, and no torch.compile warm-up.
VLLM_CPU_ARGS = {
    "engine": "vllm",
    "block_size": 32,
    "kv_cache_memory_bytes": 256 << 20,
    "enforce_eager": True,
}
