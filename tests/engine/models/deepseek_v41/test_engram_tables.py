"""Engram tables in host memory: a copy in RAM the device gathers from (engine/models/deepseek_v41/mapped_tables.py)
or the checkpoint's pages memory-mapped and gathered by host threads (engine/models/deepseek_v41/engram_tables.py)
give the same logits, bit for bit, as the tables on the device, through chunked prefill and decode (eager
and on the decode graphs' static batches); the memory-mapped rows also as a decode graph replays them (captured
and replayed through the CPU emulation of a CUDA graph, fed before each replay); the copy in RAM also under async
scheduling and on the padded batches of mixed-step graphs, both of which stay on with it."""

from __future__ import annotations

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v41.config import load_config
from engine.models.deepseek_v41.engram_tables import HostTables, choose_placement, read_stored_table
from engine.models.deepseek_v41.loader import load_model
from engine.models.deepseek_v41.mapped_tables import MappedTables
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from engine.models.deepseek_v41.shards import table_names
from engine.parallel import TensorParallel
from engine.request import SamplingParams
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


@pytest.fixture(scope="module")
def v41_fp8(tmp_path_factory):
    """v41-tiny in the released formats (FP8 Engram rows + ue8m0 scales per 32 channels), an Engram layer
    before decoder trim's cut and one after it (the split step's tail hashes and gathers its kept rows)."""
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "fp8", "v41-tiny", seed=2, quant="fp8-fp4",
                                override={"engram_layer_ids": [1, 8]})


@pytest.mark.parametrize("placement, kind", [("host", MappedTables), ("mmap", HostTables)])
def test_fp8_host_rows_dequantize_as_the_device_tables(v41_fp8, placement, kind):
    """Released-format tables kept as stored in host memory dequantize per gathered row exactly as the
    loader dequantizes the table."""
    _, want = greedy(load_model(v41_fp8, "float32", engram_tables="device"), PROMPT, 24, steps=3, dtype=torch.float32)
    model = load_model(v41_fp8, "float32", engram_tables=placement)
    assert isinstance(model.host_tables, kind) and model.needs_host_tokens == (placement == "mmap")
    assert next(iter(model.host_tables.tables.values())).rows.dtype == torch.float8_e4m3fn  # FP8 bytes as stored
    _, got = greedy(model, PROMPT, 24, steps=3, dtype=torch.float32)
    assert torch.equal(got, want)


def test_memory_mapped_rows_reach_the_decode_graphs_as_device_tables_give_them(v41_fp8, monkeypatch):
    """mmap under decode CUDA graphs, through the CPU emulation of a graph (tests/engine/graphs/graph_emulation.py:
    every recorded op replayed, allocations poisoned per replay): the runner captures each size's graph after
    prefetching its padding batch, then prefetches each step's rows into the graph's static buffers before
    the replay. Each replayed step's rows equal what the device tables give the same batch run eagerly:
    sizes 2 and 1, a size refilled for another batch, a row with no look-back yet (position 0). The step
    captured is the Engram part of the forward (each layer's rows, from the model's rows_of): under the
    emulation the whole forward costs minutes (the fused kernels interpreted), and the decode graphs'
    own tests check the rest of it."""
    from engine.models.deepseek_v41 import model as v41_model
    from engine.models.deepseek_v41.cache import V41KVCache
    from engine.runner import ModelRunner
    from engine.sequence import Sequence
    from tests.engine.graphs.graph_emulation import capture

    device = load_model(v41_fp8, "float32", engram_tables="device")
    model = load_model(v41_fp8, "float32", engram_tables="mmap")
    layers = model.cfg.engram_layer_ids

    def engram_rows(m, fb):  # [T, layers, cols, head_dim]
        rows = m.rows_of(fb, torch.float32).engram
        return torch.stack([rows[i] for i in layers], dim=1)

    capturing = []

    def capture_graph(run, pool):
        capturing.append(True)
        try:
            return capture(run, pool)
        finally:
            capturing.clear()

    monkeypatch.setattr(v41_model, "graph_capturing", lambda fb: bool(capturing))
    monkeypatch.setattr(model, "forward", lambda fb, cache: engram_rows(model, fb))
    cache = V41KVCache(model.cfg, 16, 16, 16, 2, torch.float32)
    runner = ModelRunner(model, cache, max_model_len=128)
    runner._capture([1, 2], "emulated", capture_graph)
    seqs = [Sequence(str(i), PROMPT[:n], SamplingParams()) for i, n in enumerate((1, 30))]
    for s in seqs:  # each prompt's last token is the first decode's input
        s.num_computed_tokens = s.compress_from = s.num_tokens - 1
    for step, which in enumerate(([0, 1], [1], [0, 1])):
        scheduled = [(seqs[i], 1) for i in which]
        for s, _ in scheduled:
            cache.allocate(s.blocks, 0, s.num_tokens)
        want = engram_rows(device, runner.build_batch(scheduled))
        assert want.abs().amax(-1).gt(0).all()  # every row read something
        got = runner.run(scheduled)
        assert torch.equal(got, want), f"step {step}"
        for s, _ in scheduled:
            s.num_computed_tokens = s.compress_from = s.num_tokens
            s.output_token_ids.append(11 + 97 * step)
    assert runner.replays == 3 and [runner.graphs[b].graph.replays for b in (1, 2)] == [1, 2]


def test_host_tables_under_async_scheduling_and_mixed_step_batches_equal_device_tables(v41_fp8):
    """Async scheduling on (a decode's input token still pending on the device when the step is packed)
    and mixed prefill + decode steps on the padded batches the mixed graphs replay, split at decoder trim's
    cut: the device hashes and gathers from the host's copy exactly what device tables give."""
    prompts = [[5 + (i * 7 + j * 31) % 3900 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs, engines = {}, {}
    for placement in ("device", "host"):
        llm = LLM(str(v41_fp8), dtype="float32", max_model_len=256, max_num_batched_tokens=40, max_num_seqs=8,
                  engram_tables=placement, async_scheduling=True)
        eng = engines[placement] = llm.engine
        assert eng.async_scheduling and not eng.model.needs_host_tokens
        eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs,
                                           mixed_sizes(eng.args.max_num_batched_tokens))
        outs[placement] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["host"] == outs["device"]
    mixed = engines["host"].runner.mixed
    assert mixed.replays > 3 and mixed.split is not None and mixed.split.engram == (8,)
    assert any(K < size for size, K in mixed.split.steps)  # tails that kept fewer rows than the front ran


def test_each_rank_gathers_its_rows_and_zeros_that_sum_to_the_table(v41_fp8):
    """Tensor parallelism: rank r's copy holds rows [R r / N, R (r + 1) / N) of each table; its gathers of
    any ids give its rows and zeros elsewhere, so the ranks' all-reduce is the whole table's gather."""
    cfg = load_config(v41_fp8)
    ids = torch.arange(cfg.engram_num_embeddings[0]).view(-1, 1)
    layer = cfg.engram_layer_ids[0]

    def gathered(world: int, rank: int) -> torch.Tensor:
        span = TensorParallel(rank, world, share_only=True).row_span(cfg.engram_num_embeddings[0])
        tables = MappedTables({layer: read_stored_table(v41_fp8, table_names(layer), *span)}, {layer: span},
                              torch.float32, torch.device("cpu"), copy=True)
        return tables.start(lambda: ids.unsqueeze(1), [(0, layer)], ids.shape)(layer)

    whole = gathered(1, 0)
    parts = [gathered(3, r) for r in range(3)]
    assert all(p.abs().sum(-1).eq(0).any() for p in parts)  # each rank: zeros for the others' rows
    assert torch.equal(sum(parts), whole) and whole.abs().sum(-1).gt(0).all()


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
def test_memory_mapped_tables_refuse_async_scheduling():
    """mmap: the rows are gathered from the step's tokens on the host: none may still be pending there."""
    with pytest.raises(InvalidEngineArgs, match="async_scheduling"):
        LLMEngine(dict(model=str(ORACLE), dtype="float32", engram_tables="mmap", async_scheduling=True))
