"""The memory plan (engine/models/deepseek_v41/memory_plan.py): from the headers alone, each rank's
weights as the loader then holds them, the Engram tables in host memory, and a refusal naming what
would fit."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.config import load_config
from engine.models.deepseek_v41.loader import load_model
from engine.models.deepseek_v41.memory_plan import MemoryPlanError, plan_memory
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from engine.models.loading import device_bytes
from engine.parallel import TensorParallel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("plan"), "v41-tiny", seed=1)


@pytest.mark.parametrize("world, ep, placement", [(1, False, "device"), (2, True, "device"), (2, False, "mmap")])
def test_plan_matches_what_the_loader_holds(ckpt, world, ep, placement):
    cfg, cpu = load_config(ckpt), torch.device("cpu")
    for rank in range(world):
        tp = TensorParallel(rank, world, ep)
        plan = plan_memory(ckpt, cfg, tp, placement, cpu, torch.float32)
        model = load_model(ckpt, "float32", tp=tp, engram_tables=placement)
        held = device_bytes(model) - sum(b.numel() * b.element_size() for b in model.buffers())  # hash / RoPE tables
        assert plan.weights == pytest.approx(held, rel=1e-3)
        host = 0 if model.host_tables is None else model.host_tables.nbytes
        assert plan.engram_host == host


def test_refused_when_it_cannot_fit(ckpt):
    cfg, cpu = load_config(ckpt), torch.device("cpu")
    plan = plan_memory(ckpt, cfg, TensorParallel(), "device", cpu, torch.float32)
    small = plan_memory(ckpt, cfg, TensorParallel(), "device", cpu, torch.float32, device_total=plan.weights // 2)
    with pytest.raises(MemoryPlanError, match="larger tensor_parallel_size, engram_tables: host or mmap"):
        small.check(TensorParallel())
    host = plan_memory(ckpt, cfg, TensorParallel(0, 2), "host", cpu, torch.float32, host_bytes=1000)
    assert host.engram_host > 500
    with pytest.raises(MemoryPlanError, match="engram_tables: mmap"):
        host.check(TensorParallel(0, 2))
    assert any("Engram tables in host memory" in line for line in host.lines(TensorParallel(0, 2)))
