"""Engram tables in host memory (engine/models/deepseek_v41/engram_tables.py): a copy in RAM or the
checkpoint's pages memory-mapped give the same logits, bit for bit, as the tables on the device,
through chunked prefill and decode (eager and on the decode graphs' static batches)."""

from __future__ import annotations

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v41.engram_tables import choose_placement
from engine.models.deepseek_v41.loader import load_model
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from tests.engine.models.deepseek_v41.oracle import ORACLE, greedy, needs_oracle

PROMPT = [7 + (j * 37) % 3000 for j in range(40)]


@needs_oracle
@pytest.mark.parametrize("placement", ["host", "mmap"])
def test_host_tables_equal_device_tables(placement):
    """The oracle checkpoint (transformers' names, float tables), float64: identical logits."""
    want_tokens, want = greedy(load_model(ORACLE, "float64", engram_tables="device"), PROMPT, 24, steps=6,
                               decode_batches=(1, 2))
    model = load_model(ORACLE, "float64", engram_tables=placement)
    assert model.host_tables is not None and all(b.engram.embed is None for b in model.layers if hasattr(b, "engram"))
    tokens, got = greedy(model, PROMPT, 24, steps=6, decode_batches=(1, 2))
    assert tokens == want_tokens
    assert torch.equal(got, want)


def test_fp8_host_rows_dequantize_as_the_device_tables(tmp_path):
    """Released-format tables (FP8 rows, a ue8m0 scale per 32 channels, official names) kept as
    stored in host memory dequantize per gathered row exactly as the loader dequantizes the table."""
    path = write_v41_checkpoint(tmp_path, "v41-tiny", seed=2, quant="fp8-fp4")
    _, want = greedy(load_model(path, "float32", engram_tables="device"), PROMPT, 24, steps=3, dtype=torch.float32)
    model = load_model(path, "float32", engram_tables="mmap")
    assert next(iter(model.host_tables.tables.values())).rows.dtype == torch.float8_e4m3fn  # FP8 bytes, mapped
    _, got = greedy(model, PROMPT, 24, steps=3, dtype=torch.float32)
    assert torch.equal(got, want)


def test_placement_choice_and_refusals(tmp_path):
    cpu = torch.device("cpu")
    assert choose_placement("auto", 1 << 40, cpu) == "device"  # the CPU's tables are host memory already
    assert choose_placement("mmap", 0, cpu) == "mmap"
    with pytest.raises(ValueError, match="engram_tables"):
        choose_placement("disk", 0, cpu)
    v4 = tmp_path / "v4"
    from engine.models.deepseek_v4.random_checkpoint import write_checkpoint

    write_checkpoint(v4, "tiny")
    with pytest.raises(InvalidEngineArgs, match="no Engram tables"):
        LLMEngine(dict(model=str(v4), dtype="float32", engram_tables="host"))
    with pytest.raises(InvalidEngineArgs, match="engram_tables must be one of"):
        LLMEngine(dict(model=str(v4), dtype="float32", engram_tables="disk"))


@needs_oracle
def test_host_tables_refuse_async_scheduling():
    """The rows are gathered from the step's tokens on the host: none may still be pending there."""
    with pytest.raises(InvalidEngineArgs, match="async_scheduling"):
        LLMEngine(dict(model=str(ORACLE), dtype="float32", engram_tables="host", async_scheduling=True))
