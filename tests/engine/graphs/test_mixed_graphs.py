"""Mixed prefill + decode steps through the padded, fixed-shape batches that the CUDA graphs
replay (engine/graphs/mixed.py). On the CPU the same padded batches run eagerly, so these tests
compare them with the unpadded eager path: the same greedy tokens, and logprobs to the
rounding of the float32 logits (float64 model), through chunked prefill mixed with decodes and
prefix-cache hits with bounded replay (compress_from above a chunk's start)."""

import numpy as np
import pytest
import torch

from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.graphs.static_batch import new_token_ids
from engine.llm import LLM
from engine.request import SamplingParams
from engine.sequence import Sequence

pytestmark = [pytest.mark.usefixtures("single_thread")]


def _prompts(n, vocab, seed, shared=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(5, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(3, 50, (n,), generator=g)]


def _run(path, prompts, params, padded: bool, warm=None, **args):
    llm = LLM(str(path), dtype="float64", max_model_len=256, **args)
    eng = llm.engine
    if padded:
        eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs,
                                      mixed_sizes(eng.args.max_num_batched_tokens))
    if warm:
        llm.generate(warm, params)
    outs = llm.generate(prompts, params)
    return outs, eng


def _same(a_outs, b_outs):
    assert [o.token_ids for o in a_outs] == [o.token_ids for o in b_outs]
    for a, b in zip(a_outs, b_outs):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) <= 1e-5 for k in la)


@pytest.mark.parametrize("shape", ["tiny", "official-ratios"])
def test_padded_mixed_steps_equal_the_unpadded_path(checkpoints, shape):
    prompts = _prompts(7, 4000, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(max_num_batched_tokens=40, max_num_seqs=8, num_gpu_blocks_override=16)
    eager, e_eng = _run(checkpoints[shape], prompts, params, padded=False, **args)
    padded, p_eng = _run(checkpoints[shape], prompts, params, padded=True, **args)
    _same(eager, padded)
    assert p_eng.runner.mixed.replays > 5  # the mixed steps went through the padded batches
    assert p_eng.runner.eager_steps + p_eng.runner.mixed.replays == e_eng.runner.eager_steps


def test_padded_mixed_steps_with_prefix_cache_hits_and_replay(tiny_dir):
    warm, *prompts = _prompts(5, 4000, seed=5, shared=50)  # hits longer than the window: bounded replay
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    args = dict(max_num_batched_tokens=64, enable_prefix_caching=True)
    eager, _ = _run(tiny_dir, prompts, params, padded=False, warm=[warm], **args)
    padded, eng = _run(tiny_dir, prompts, params, padded=True, warm=[warm], **args)
    _same(eager, padded)
    assert eng.stats()["prefix_cache_replayed_tokens"] > 0


def test_packed_rows_equal_build_batch_and_the_rest_is_padding(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64)
    eng = llm.engine
    mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [64])
    from engine.request import GenerationRequest
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, n in enumerate((5, 40, 90)):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=[7 + (j * 13 + i) % 200 for j in range(n)],
                                          sampling=sp))
    eng.step()
    eng.step()
    scheduled = eng.scheduler.schedule()
    assert any(k == 1 for _, k in scheduled) and any(k > 1 for _, k in scheduled)  # a mixed step
    st = mixed.static[64]
    host = np.full(st.layout.size, 12345, dtype=np.int64)
    n_logits = mixed.pack(scheduled, 64, host)
    st.flat.copy_(torch.from_numpy(host))
    want, fb, T = eng.runner.build_batch(scheduled), st.fb, sum(k for _, k in scheduled)
    for name in ("input_ids", "positions", "window_slots", "token_seq"):
        assert getattr(fb, name)[:T].tolist() == getattr(want, name).tolist(), name
        assert (getattr(fb, name)[T:] == torch.from_numpy(st.pad)[st.layout.fields[name][0]:][T:st.layout.T]).all()
    S = len(scheduled)
    assert fb.replay_start_t[:S].tolist() == want.replay_start_t.tolist()
    assert fb.state_slot_t[:S].tolist() == want.state_slot_t.tolist()
    assert fb.logits_rows[:n_logits].tolist() == want.logits_rows.tolist()
    for name in ("window_tables", "full_tables"):
        got, ref = getattr(fb, name)[:S], getattr(want, name)
        assert got[:, :ref.shape[1]].tolist() == ref.tolist()
    assert (fb.window_tables[S:] == eng.cache.scratch_window).all() and (fb.full_tables[S:] == eng.cache.scratch_full).all()


def test_new_token_ids_slices_prompt_and_output():
    seq = Sequence("s", [1, 2, 3, 4], SamplingParams())
    seq.output_token_ids = [5, 6, 7]
    for start in range(7):
        for n in range(1, 8 - start):
            assert new_token_ids(seq, start, n) == seq.token_ids[start:start + n]


@pytest.mark.slow
def test_emulated_graph_replays_equal_the_padded_batches_run_eagerly(kernels_tiny_dir):
    """The mixed-step graph captured and replayed through an emulation of CUDA graphs on the CPU
    (tests/engine/graphs/graph_emulation.py: every host value baked in at capture, on the all-padding
    batch as MixedStepGraphs captures it; allocations poisoned at each replay; host reads refused), with
    the fused kernels under the Triton interpreter: each replayed step's logits and every cache
    write equal the same padded batch run eagerly from the same cache state (tools/mixed_diag.py),
    and its logits the unpadded step's to float32 rounding. (About a minute of CPU: the
    interpreter runs every kernel program in Python.)"""
    import kernels
    from tests.engine.graphs.graph_emulation import capture
    from tools.mixed_diag import diagnose

    g = torch.Generator().manual_seed(4)
    # two steps: both prompts' prefills (7 tokens: the first closes a ratio-4 group), then both
    # decodes (2: the second closes one), each padded to 8 (not 16: the interpreter's cost is rows)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (4, 3)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
    # the tiny preset cut for the interpreter (tests/engine/conftest.py: KERNELS_TINY)
    llm = LLM(str(kernels_tiny_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=8)
    eng = llm.engine
    try:
        kernels.set_backend("fused")  # after the engine, which sets its `kernels` argument's backend
        eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs, [8],
                                      pool="emulated", capture_fn=capture)
        rows = diagnose(eng, lambda: llm.generate(prompts, params))
    finally:
        kernels.set_backend("auto")
    assert [(r["path"], r["tokens"], r["graph_size"]) for r in rows] == [("mixed", 7, 8), ("mixed", 2, 8)]
    assert eng.runner.mixed.static[8].graph.replays == 2
    for r in rows:
        assert r["first_difference"] is None, r
        assert r["logits_graph_vs_padded_eager"] == 0.0, r
        # host values the padded batch and its replay would share (both built from the static batch) show here
        assert r["logits_padded_vs_unpadded_eager"] <= 1e-4, r
