"""DeepSeek-V4.1 mixed prefill + decode steps through the padded, fixed-shape batches that the CUDA
graphs replay (engine/mixed_graphs.py with engine/mixed_rows_v41.py), on the CPU.

The padded path carries every value V4.1's forward took from the host: the compressors' plans
padded to their cap, the Engram look-back, decoder replay's kept rows at a fixed capacity, and the
indexer's scores over fixed-width rows. These tests run the padded batches eagerly against the
unpadded eager path (same greedy tokens, logprobs within a stated bound) through chunked prefill
mixed with decodes, decoder replay off and on, a prefix-cache hit and continuous batching, on the
oracle checkpoint and the v41-tiny preset; and the padded step captured and replayed through the
CPU emulation of a CUDA graph (tests/engine/graph_emulation.py) against the same batch run eagerly.

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

from engine.llm import LLM
from engine.mixed_graphs import MixedSteps, mixed_sizes
from engine.mixed_rows_v41 import PLAN_KEY
from engine.request import SamplingParams
from tests.engine.v41_oracle import ORACLE, needs_oracle

pytestmark = [pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def v41_tiny(tmp_path_factory):
    from engine.random_checkpoint_v41 import write_v41_checkpoint

    return write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "bf16", "v41-tiny", seed=3, quant="bf16")


def _prompts(n, vocab, seed, shared=0, lo=3, hi=60):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(5, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(lo, hi, (n,), generator=g)]


def _run(path, prompts, params, padded: bool, warm=None, **args):
    llm = LLM(str(path), dtype="float64", max_model_len=256, **args)
    eng = llm.engine
    if padded:
        eng.runner.mixed = MixedSteps(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs,
                                      mixed_sizes(eng.args.max_num_batched_tokens), trim_eagerly=False)
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
    window: decoder replay drops rows) mixed with decodes; continuous batching (prompts finish at
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


@needs_oracle
def test_oracle_padded_mixed_steps_with_a_prefix_cache_hit():
    """A warm request, then prompts sharing its 40-token prefix (a hit beyond the window:
    encoder-side bounded replay, compress_from above the chunk's start), decoder replay on."""
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
def test_kept_rows_and_look_back_are_packed_and_the_rest_is_padding(v41_golden):
    """One mixed step (a decode, a 30-token chunk, a 1-token chunk) in a 32-row batch: the kept rows
    are each sequence's last 16 (window), their metadata that of the full rows, padding elsewhere
    (the padding sequence, the scratch block); the look-back is the runner's build_batch's."""
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
    mixed = MixedSteps(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32])
    st = mixed.static[32]
    host = np.full(st.layout.size, 12345, dtype=np.int64)
    n_logits = mixed.pack(scheduled, 32, host)
    st.flat.copy_(torch.from_numpy(host))
    want, fb = eng.runner.build_batch(scheduled), st.fb
    T, W = sum(k for _, k in scheduled), eng.cfg.sliding_window
    assert fb.lookback_ids[:T].tolist() == want.lookback_ids.tolist()
    assert (fb.lookback_ids[T:] == -1).all()
    dr = fb.plans[PLAN_KEY]
    keep, row = [], 0
    for _, k in scheduled:
        keep += range(row + k - min(k, W), row + k)
        row += k
    K = len(keep)
    assert dr.keep[:K].tolist() == keep and (dr.keep[K:] == 0).all()
    for name in ("positions", "token_seq", "window_slots"):
        assert getattr(dr, name)[:K].tolist() == getattr(want, name)[keep].tolist(), name
    assert (dr.token_seq[K:] == st.layout.S - 1).all()
    assert (dr.window_slots[K:] == eng.cache.scratch_window * eng.cache.block_size).all()
    for i, (s, k) in enumerate(scheduled):  # a sequence that drops rows reads none below its first kept one
        first = s.num_computed_tokens + k - W if k > W else 0
        assert dr.replay_start_t[i] == max(s.replay_start, first)
    new_index = {r: j for j, r in enumerate(keep)}
    assert dr.logits_rows[:n_logits].tolist() == [new_index[r] for r in want.logits_rows.tolist()]


@needs_oracle
def test_steps_decoder_replay_trims_to_half_run_eagerly():
    """A graph of T tokens runs its capacity of kept rows (min(T, L * window)) on the trimmed layers,
    the eager step only the kept ones: a step whose kept rows are at most half that capacity (a long
    chunk) runs eagerly; decode-heavy steps, a capacity that trims as much (L = 1) and decoder replay
    off replay the graph."""
    llm = LLM(str(ORACLE), dtype="float64", max_model_len=256, max_num_batched_tokens=32)
    eng = llm.engine
    W = eng.cfg.sliding_window
    assert W == 16
    rows = eng.model.mixed_rows(eng.cache)
    assert rows.prefers_eager([(None, 32)], 32, 32)  # keeps 16 of a capacity of 32
    assert not rows.prefers_eager([(None, 1)] * 20 + [(None, 12)], 32, 32)  # keeps every row
    assert not rows.prefers_eager([(None, 32)], 32, 1)  # capacity 16: the graph trims as much
    mixed = MixedSteps(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32])
    assert not mixed.fits([(None, 30)]) and mixed.fits([(None, 1)] * 20 + [(None, 12)])
    assert MixedSteps(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32],
                      trim_eagerly=False).fits([(None, 30)])
    eng.model.decoder_replay = False
    assert not rows.prefers_eager([(None, 32)], 32, 32) and mixed.fits([(None, 30)])


@needs_oracle
@pytest.mark.slow
def test_emulated_graph_replays_equal_the_padded_batches_run_eagerly(monkeypatch):
    """The padded mixed step captured once (on the all-padding batch, as MixedSteps captures it)
    and replayed through the CPU emulation of a CUDA graph (host values baked in at capture,
    allocations poisoned per replay, host reads refused), the fused kernels under the Triton
    interpreter, the routed experts through the grouped MoE kernel CUDA runs (the CPU's per-expert
    loop reads the routing on the host), decoder replay on: a prefill of a 6-token prompt and 26
    tokens of a 40-token one (decoder replay drops 10 of those rows), then a mixed step (the 14
    left and a decode), then a decode (measured: graph vs padded eager 0.0, padded vs unpadded
    <= 8.1e-6). Each replayed step's logits equal the same padded batch run
    eagerly from the same cache state, and so does every cache write (tools/mixed_diag.py); the
    padded step's logits the unpadded one's to float32 rounding, and the greedy tokens the
    unpadded reference path's. (Minutes of CPU: the interpreter runs every kernel program in Python.)"""
    import kernels
    from tests.engine.graph_emulation import capture
    from tools.mixed_diag import diagnose

    prompts = _prompts(2, 4000, seed=9, lo=40, hi=41)
    prompts = [prompts[0][:6], prompts[1]]  # 6 and 40 tokens: 32-token steps
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
    from engine import v41_ops

    path = str(ORACLE)
    want = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32).generate(prompts, params)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32)
    eng = llm.engine
    try:
        kernels.set_backend("fused")  # after the engine, which sets its `kernels` argument's backend
        monkeypatch.setattr(v41_ops, "routed_experts", lambda x, w1, w3, w2, weights, indices, limit: kernels.moe_experts(
            x, w1, w3, w2, weights.to(x.dtype), indices, limit, None))
        eng.runner.mixed = MixedSteps(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [32],
                                      pool="emulated", capture_fn=capture, trim_eagerly=False)
        got = []
        rows = diagnose(eng, lambda: got.extend(llm.generate(prompts, params)))
    finally:
        kernels.set_backend("auto")
    print(rows)
    # no decode graphs on the CPU: the last decode replays the mixed graph too
    assert [(r["path"], r["tokens"]) for r in rows] == [("mixed", 32), ("mixed", 15), ("mixed", 1)]
    assert eng.runner.mixed.static[32].graph.replays == 3
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for r in rows:
        assert r["first_difference"] is None, r
        assert r["logits_graph_vs_padded_eager"] == 0.0, r
        assert r["logits_padded_vs_unpadded_eager"] <= 1e-4, r


def test_topk_first_is_topk_with_ties_to_the_lower_index():
    """The two-level top-k's pick (engine.v41_ops.topk_first): torch.topk's where scores differ;
    among equal ones the lower index, whatever the row's length (a padded step's rows are longer)."""
    from engine.v41_ops import topk_first

    x = torch.randn(40, 300)
    v, i = topk_first(x, 17)
    t = x.topk(17)
    assert torch.equal(v, t.values) and torch.equal(i, t.indices)
    s = torch.tensor([[0.0, 1.0, 0.0, float("-inf"), 1.0, -2.0, 0.0, float("-inf")]])
    v, i = topk_first(s, 7)
    assert i.tolist() == [[1, 4, 0, 2, 6, 5, 3]] and v[0, -1] == float("-inf")
    wide = torch.cat([s, torch.full((1, 50), float("-inf"))], dim=1)
    assert torch.equal(topk_first(wide, 5)[1], topk_first(s, 5)[1])
