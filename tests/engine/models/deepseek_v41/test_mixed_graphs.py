"""DeepSeek-V4.1 mixed prefill + decode steps through the padded, fixed-shape batches that the CUDA
graphs replay (engine/graphs/mixed.py with engine/models/deepseek_v41/mixed_rows.py), on the CPU.

The padded path carries every value V4.1's forward took from the host: the compressors' plans
padded to their cap, the Engram look-back, decoder trim's kept rows at a fixed capacity, and the
indexer's scores over fixed-width rows. These tests run the padded batches eagerly against the
unpadded eager path (same greedy tokens, logprobs within a stated bound) through chunked prefill
mixed with decodes, decoder trim off and on, a prefix-cache hit and continuous batching, on the
oracle checkpoint and the v41-tiny preset; and the padded step captured and replayed through the
CPU emulation of a CUDA graph (tests/engine/graphs/graph_emulation.py) against the same batch run eagerly.

Tolerance: padding adds GEMM rows, which moves float64 rounding by ~1e-16; the reference's float32
stages lift that to ~1e-6, and where a fake-quantiser then lands across a rounding step a logit
moves by up to ~5e-3 (golden.json: 7.4e-3 between transformers' own cached and uncached runs). So
logprobs agree to 1e-4 except at such isolated flips, counted and bounded (at most 2 per run, each
below 1e-2); the greedy tokens are the same throughout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.llm import LLM
from engine.request import SamplingParams
from tests.engine.models.deepseek_v41.oracle import ORACLE, needs_oracle

pytestmark = [pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def v41_tiny(tmp_path_factory):
    from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint

    return write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "bf16", "v41-tiny", seed=3, quant="bf16")


# v41-tiny's layer kinds in 5 layers, not 10, half its attention heads and a quarter of its indexer
# heads (under the Triton interpreter a step costs its kernel launches times their grids, rows x
# heads: the indexer's query heads were half the rope and fake-quant programs), 3 Sinkhorn
# iterations, not 20 (a loop in the hc kernel; its count is no code path). Before the cut: a sliding layer
# (Engram), a ratio-2 KV source (Engram), the ratio-1 KV source that picks the candidate blocks;
# after it, a layer attending with the top-k the front left and one whose own indexer reads the
# front's candidate blocks: what crosses the cut, as in the oracle's tail.
SPLIT_SMALL = dict(num_hidden_layers=5, compress_ratios=[0, 2, 1, 1, 1], kv_source_layer_ids=[1, 2],
                   index_source_layer_ids=[1, 2, 4], candidate_source_layer_id=2, engram_layer_ids=[0, 1],
                   num_attention_heads=2, index_n_heads=2, hc_sinkhorn_iters=3)


def _prompts(n, vocab, seed, shared=0, lo=3, hi=60):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(5, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(lo, hi, (n,), generator=g)]


def _run(path, prompts, params, padded: bool, warm=None, on_engine=None, **args):
    llm = LLM(str(path), dtype="float64", max_model_len=256, **args)
    eng = llm.engine
    if on_engine:
        on_engine(eng)
    if padded:
        eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs,
                                      mixed_sizes(eng.args.max_num_batched_tokens))
    if warm:
        llm.generate(warm, params)
    return llm.generate(prompts, params), eng


def _compare(a_outs, b_outs) -> list[float]:
    """Same tokens; the logprob differences above 1e-4 (fake-quant flips), each below 1e-2."""
    assert [o.token_ids for o in a_outs] == [o.token_ids for o in b_outs]
    flips = []
    for a, b in zip(a_outs, b_outs):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            flips += [abs(la[k] - lb[k]) for k in la if abs(la[k] - lb[k]) > 1e-4]
    print(f"logprob differences above 1e-4: {flips}")
    assert len(flips) <= 2 and all(f < 1e-2 for f in flips), flips
    return flips


def _mixed_steps_ran(eng, e_eng) -> None:
    assert eng.runner.mixed.replays > 5
    assert eng.runner.eager_steps + eng.runner.mixed.replays == e_eng.runner.eager_steps


@needs_oracle
@pytest.mark.parametrize("replay", [False, True])
def test_oracle_mixed_steps_on_padded_batches_equal_the_unpadded_path(v41_golden, replay):
    """The four golden prompts and three others at once, 24-token chunks (longer than the 16-token
    window: decoder trim drops rows) mixed with decodes; continuous batching (prompts finish at
    different lengths). Replay off, the golden prompts' tokens are transformers' own."""
    prompts = [v41_golden[f"prompt_ids_{i}"].tolist() for i in range(4)] + _prompts(3, 4000, seed=2)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
              for n in (16, 12, 10, 8, 6, 9, 14)]
    args = dict(max_num_batched_tokens=24, max_num_seqs=8, swa_bounded_replay=replay)
    eager, e_eng = _run(ORACLE, prompts, params, padded=False, **args)
    padded, p_eng = _run(ORACLE, prompts, params, padded=True, **args)
    _compare(eager, padded)
    _mixed_steps_ran(p_eng, e_eng)
    if not replay:
        for i in range(4):
            assert padded[i].token_ids == v41_golden[f"greedy_ids_{i}"].tolist()[:len(padded[i].token_ids)]


def test_engram_layers_after_the_split_hash_the_kept_rows_under_async_scheduling(tmp_path_factory):
    """v41-tiny with an Engram layer after the last KV source (layer 8, in the tail): the tail hashes
    its kept rows' own ids and look-back, a decode's id still pending (async scheduling: greedy, no
    logprobs) written into the tail's batch as into the front's. Same tokens as the unpadded eager
    steps (a tail that hashed the placeholder instead changes them)."""
    from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint

    path = write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "engram8", "v41-tiny", seed=3,
                                override={"engram_layer_ids": [1, 8]}, quant="bf16")
    prompts = _prompts(6, 4000, seed=3, hi=70)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    args = dict(max_num_batched_tokens=40, max_num_seqs=256, async_scheduling=True)
    eager, e_eng = _run(path, prompts, params, padded=False, **args)
    filled = []
    padded, p_eng = _run(path, prompts, params, padded=True, on_engine=lambda eng: _count_pending(eng, filled), **args)
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    _mixed_steps_ran(p_eng, e_eng)
    split = p_eng.runner.mixed.split
    assert split.engram == (8,) and all("lookback_ids" in st.layout.fields for st in split.static.values())
    assert any(K < size for size, K in split.steps)
    assert sum(filled) > 0  # mixed steps took pending decodes


def _count_pending(eng, filled: list) -> None:
    """Collect how many rows each of the runner's fill_pending calls writes."""
    fill = eng.runner._fill_pending

    def counted(input_ids, scheduled, pending, last_rows):
        filled.append(sum(s.has_pending_token for s, _ in scheduled))
        return fill(input_ids, scheduled, pending, last_rows)
    eng.runner._fill_pending = counted


@needs_oracle
def test_oracle_padded_mixed_steps_with_a_prefix_cache_hit():
    """A warm request, then prompts sharing its 40-token prefix (a hit beyond the window:
    bounded replay, compress_from above the chunk's start), decoder trim on."""
    warm, *prompts = _prompts(4, 4000, seed=5, shared=40)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    args = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    eager, _ = _run(ORACLE, prompts, params, padded=False, warm=[warm], **args)
    padded, eng = _run(ORACLE, prompts, params, padded=True, warm=[warm], **args)
    _compare(eager, padded)
    assert eng.stats()["prefix_cache_replayed_tokens"] > 0


@pytest.mark.parametrize("replay", [False, True])
def test_v41_tiny_preset_mixed_steps_on_padded_batches_equal_the_unpadded_path(v41_tiny, replay):
    prompts = _prompts(6, 4000, seed=3, hi=70)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(max_num_batched_tokens=40, max_num_seqs=8, swa_bounded_replay=replay)
    eager, e_eng = _run(v41_tiny, prompts, params, padded=False, **args)
    padded, p_eng = _run(v41_tiny, prompts, params, padded=True, **args)
    _compare(eager, padded)
    _mixed_steps_ran(p_eng, e_eng)


@needs_oracle
def test_front_and_tail_batches_are_packed_and_the_rest_is_padding(v41_golden):
    """One mixed step (a decode, a 30-token chunk, a 1-token chunk) in a 32-row front batch: its
    look-back is the runner's build_batch's; the tail batch holds each sequence's last 16 (window)
    rows, with the metadata of the full rows, `keep` their rows in the front, padding elsewhere (the
    padding sequence, the scratch block), and the smallest bucket that holds them."""
    from engine.request import GenerationRequest

    llm = LLM(str(ORACLE), dtype="float64", max_model_len=256, max_num_batched_tokens=32)
    eng = llm.engine
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ids = v41_golden["prompt_ids_3"].tolist()
    for i, n in enumerate((5, 100, 3)):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=ids[i:i + n], sampling=sp))
    eng.step()
    eng.step()
    scheduled = eng.scheduler.schedule()
    assert sorted(k for _, k in scheduled)[0] == 1 and max(k for _, k in scheduled) > 16
    mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32])
    st = mixed.static[32]
    host = np.full(st.layout.size, 12345, dtype=np.int64)
    n_logits = mixed.pack(scheduled, 32, host)
    st.flat.copy_(torch.from_numpy(host))
    want, fb = eng.runner.build_batch(scheduled), st.fb
    T, W = sum(k for _, k in scheduled), eng.cfg.sliding_window
    assert fb.lookback_ids[:T].tolist() == want.lookback_ids.tolist()
    assert (fb.lookback_ids[T:] == -1).all()
    keep, row = [], 0
    for _, k in scheduled:
        keep += range(row + k - min(k, W), row + k)
        row += k
    split, K = mixed.split, len(keep)
    assert split.sizes == [16, 32] and split.bucket(scheduled) == min(b for b in (16, 32) if b >= K)
    tail = split.static[split.bucket(scheduled)]
    host = np.full(tail.layout.size, 12345, dtype=np.int64)
    assert split.pack(scheduled, tail.layout.T, host) == n_logits
    tail.flat.copy_(torch.from_numpy(host))
    tb, v = tail.fb, tail.views
    assert v["keep"][:K].tolist() == keep and (v["keep"][K:] == 0).all()
    assert tb.input_ids[:K].tolist() == want.input_ids[keep].tolist()
    for name in ("positions", "token_seq", "window_slots"):
        assert getattr(tb, name)[:K].tolist() == getattr(want, name)[keep].tolist(), name
    assert (tb.token_seq[K:] == tail.layout.S - 1).all()
    assert (tb.window_slots[K:] == eng.cache.scratch_window * eng.cache.block_size).all()
    S, cols = len(scheduled), want.window_tables.shape[1]
    assert torch.equal(tb.window_tables[:S, :cols], want.window_tables)
    assert torch.equal(tb.full_tables[:S, :cols], want.full_tables)
    assert (tb.window_tables[S:] == eng.cache.scratch_window).all()
    for i, (s, k) in enumerate(scheduled):  # a sequence that drops rows reads none below its first kept one
        first = s.num_computed_tokens + k - W if k > W else 0
        assert tb.replay_start_t[i] == max(s.replay_start, first)
    new_index = {r: j for j, r in enumerate(keep)}
    assert tb.logits_rows[:n_logits].tolist() == [new_index[r] for r in want.logits_rows.tolist()]


@needs_oracle
def test_a_step_splits_where_decoder_replay_trims(monkeypatch):
    """With decoder trim on, a padded step is a front (every row to the last KV source) and a tail
    over the smallest bucket holding its kept rows; replay switched off after capture keeps every
    row; a MixedStepGraphs built with replay off, or for a model with nothing after its last KV source,
    is one graph per size."""
    llm = LLM(str(ORACLE), dtype="float64", max_model_len=256, max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.cfg.sliding_window == 16 and eng.model.trim_cut == 7 < eng.cfg.num_layers
    mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, 256, [32, 64])
    split = mixed.split
    assert split.sizes == [16, 32, 64] and mixed.num_graphs() == 0  # no pool: nothing captured
    assert split.bucket([(None, 64)]) == 16  # one chunk: its last window
    assert split.bucket([(None, 1)] * 20 + [(None, 30)]) == 64  # 20 decodes and a window
    assert split.bucket([(None, 1)] * 8 + [(None, 5)]) == 16
    eng.model.decoder_trim = False
    assert split.bucket([(None, 64)]) == 64  # every row
    assert MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, 256, [64]).split is None
    eng.model.decoder_trim = True
    monkeypatch.setattr(type(eng.model), "trim_cut", property(lambda m: len(m.layers)))
    assert MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, 256, [64]).split is None


@needs_oracle
def test_serving_max_num_seqs_steps_run_the_later_layers_on_the_kept_rows_only():
    """At a serving max_num_seqs (256: one graph per token count would have kept every row) the
    padded steps' tails run the kept rows only (a whole 64-token chunk in the 16-row bucket, chunks of
    two prompts in the 32-row one): the same greedy tokens and logprobs (the module's tolerance; no
    difference above 1e-4 seen) as the unpadded eager steps, which trim."""
    prompts = _prompts(3, 4000, seed=4, lo=100, hi=160)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(max_num_batched_tokens=64, max_num_seqs=256)
    eager, e_eng = _run(ORACLE, prompts, params, padded=False, **args)
    padded, p_eng = _run(ORACLE, prompts, params, padded=True, **args)
    _compare(eager, padded)
    _mixed_steps_ran(p_eng, e_eng)
    steps = p_eng.runner.mixed.split.steps  # (front size, tail bucket) -> steps; measured {64/16: 1, 64/32: 5, 16/16: 4}
    print(dict(steps))
    assert steps[64, 16] >= 1  # a whole chunk of one prompt: its last window
    assert sum(c for (size, K), c in steps.items() if size == 64) >= 5
    assert all(K <= 32 for size, K in steps if size == 64)  # the chunks of two prompts: two windows


@pytest.mark.slow
def test_emulated_graph_replays_equal_the_padded_batches_run_eagerly(monkeypatch, tmp_path_factory):
    """The padded mixed step of the 5-layer SPLIT_SMALL model captured once (on the all-padding
    batch, as MixedStepGraphs captures it) and replayed through the CPU emulation of a CUDA graph (host values baked in at capture,
    allocations poisoned per replay, host reads refused), the fused kernels under the Triton
    interpreter, the routed experts through the grouped MoE kernel CUDA runs (the CPU's per-expert
    loop reads the routing on the host), decoder trim on, so the step is a front graph of 32 rows
    and a tail graph per kept-row bucket (16, 32): the prefills of a 6- and a 26-token prompt
    (decoder trim drops 10 rows of the second: 22 kept, tail 32), then a mixed step (a 14-token
    prompt and both first prompts' decodes: tail 16), where every request ends (two steps, not a third
    pure decode: the interpreter makes each step minutes; decode graphs have their own tests). Every
    prompt's last row is a logits row of one of the two steps, so a tail that reads another row's
    state (its top-k, its candidate blocks) shows against the unpadded step. Each replayed step's
    logits equal the same padded batch run eagerly from the same cache state, and so does every cache write (tools/mixed_diag.py); the
    padded step's logits the unpadded one's to float32 rounding, and the greedy tokens the
    unpadded reference path's. (Minutes of CPU: the interpreter runs every kernel program in Python.)"""
    import kernels
    from tests.engine.graphs.graph_emulation import capture
    from tools.mixed_diag import diagnose

    prompts = _prompts(3, 4000, seed=9, lo=40, hi=41)
    prompts = [prompts[0][:6], prompts[1][:26], prompts[2][:14]]  # a 32-token prefill step, then 14 + 2 decodes
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (2, 2, 1)]
    from engine.models.deepseek_v41 import ops as v41_ops
    from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint

    path = str(write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "small", "v41-tiny", seed=3,
                                    override=SPLIT_SMALL, quant="bf16"))
    want = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32).generate(prompts, params)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32)
    eng = llm.engine
    try:
        kernels.set_backend("fused")  # after the engine, which sets its `kernels` argument's backend
        monkeypatch.setattr(v41_ops, "routed_experts", lambda x, w1, w3, w2, weights, indices, limit: kernels.moe_experts(
            x, w1, w3, w2, weights.to(x.dtype), indices, limit, None))
        eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32],
                                      pool="emulated", capture_fn=capture)
        got = []
        rows = diagnose(eng, lambda: got.extend(llm.generate(prompts, params)))
    finally:
        kernels.set_backend("auto")
    print(rows)
    assert [(r["path"], r["tokens"]) for r in rows] == [("mixed", 32), ("mixed", 16)]
    mixed = eng.runner.mixed
    assert mixed.static[32].graph.replays == 2 and mixed.num_graphs() == 3
    assert [mixed.split.static[K].graph.replays for K in (16, 32)] == [1, 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for r in rows:
        assert r["first_difference"] is None, r
        assert r["logits_graph_vs_padded_eager"] == 0.0, r
        assert r["logits_padded_vs_unpadded_eager"] <= 1e-4, r


def test_topk_first_is_topk_with_ties_to_the_lower_index():
    """The two-level top-k's pick (engine.models.deepseek_v41.ops.topk_first): torch.topk's where scores differ;
    among equal ones the lower index, whatever the row's length (a padded step's rows are longer)."""
    from engine.models.deepseek_v41.ops import topk_first

    x = torch.randn(40, 300)
    v, i = topk_first(x, 17)
    t = x.topk(17)
    assert torch.equal(v, t.values) and torch.equal(i, t.indices)
    s = torch.tensor([[0.0, 1.0, 0.0, float("-inf"), 1.0, -2.0, 0.0, float("-inf")]])
    v, i = topk_first(s, 7)
    assert i.tolist() == [[1, 4, 0, 2, 6, 5, 3]] and v[0, -1] == float("-inf")
    wide = torch.cat([s, torch.full((1, 50), float("-inf"))], dim=1)
    assert torch.equal(topk_first(wide, 5)[1], topk_first(s, 5)[1])
