"""Speculative decoding's verify steps through the padded, fixed-shape batches that the verify
CUDA graphs replay (engine/verify_graphs.py). On the CPU the same padded batches run eagerly
through the function the graphs capture, so these tests compare them with the unpadded eager
verify: the same tokens (greedy and sampled: the same logits draw the same samples), the same
acceptance counts (the rollback reads the graph's closed-block and overlap-state buffers), and
which steps took which path."""

import numpy as np
import pytest
import torch

from engine.compress_plan import compress_plan
from engine.llm import LLM
from engine.request import GenerationRequest, SamplingParams
from engine.verify_graphs import VerifySteps
from tests.engine.test_batching import _full

SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def _prompts(vocab, seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (L,), generator=g).tolist() for L in lengths]


def _run(path, prompts, params, padded, forced=None, **kw):
    llm = LLM(str(path), dtype="float64", max_model_len=256, speculative_config=SPEC, seed=3, **kw)
    spec = llm.engine.spec
    assert spec.verify_steps is None  # CPU: no decode graphs, so no verify graphs
    if padded:
        spec.verify_steps = VerifySteps(llm.engine.model, llm.engine.cache, 256, spec.k, padded)
    spec.force_drafts(forced)
    out = [o.token_ids for o in llm.generate(prompts, params)]
    assert _full(llm.engine)
    return out, llm.engine


def _corrupt(tokens, vocab):
    return [(t + 1) % vocab if i % 3 == 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("shape", ["tiny", "official-ratios"])
def test_padded_verify_equals_the_eager_verify(checkpoints, shape):
    """Three greedy and two sampled requests, chunked prefill mixed with verify steps (those run
    eagerly); the greedy ones' drafts forced to their plain tokens with every third one wrong
    (partial acceptance at every offset, so the rollback reopens blocks), the sampled ones' from
    the random MTP (rejected)."""
    path = checkpoints[shape]
    prompts = _prompts(4000, seed=4, lengths=(5, 29, 47, 18, 33))
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=14, temperature=0.9, ignore_eos=True)] * 2
    kw = dict(max_num_batched_tokens=40, max_num_seqs=5)
    plain = [o.token_ids for o in LLM(str(path), dtype="float64", max_model_len=256, **kw).generate(prompts[:3], params[:3])]
    forced = {f"offline-{i}": _corrupt(p, 4000) for i, p in enumerate(plain)}
    want, e_eng = _run(path, prompts, params, padded=None, forced=forced, **kw)
    got, p_eng = _run(path, prompts, params, padded=[2, 4, 8], forced=forced, **kw)
    assert got == want and got[:3] == plain
    e, p = e_eng.spec.stats(), p_eng.spec.stats()
    assert p == e and 0 < e["spec_decode_num_accepted_tokens"] < e["spec_decode_num_draft_tokens"]
    paths = p_eng.spec.step_paths
    assert paths["verify_graph"] > 5 and paths["verify_eager"] > 0  # decodes padded, prefill chunks eager
    assert sum(paths.values()) == e_eng.spec.step_paths["verify_eager"]
    assert paths["verify_graph"] == p_eng.spec.verify_steps.replays


def test_packed_verify_rows_equal_build_batch_and_the_rest_is_padding(checkpoints):
    llm = LLM(str(checkpoints["official-ratios"]), dtype="float32", max_model_len=256, speculative_config=SPEC)
    eng, spec = llm.engine, llm.engine.spec
    vs = VerifySteps(eng.model, eng.cache, 256, spec.k, [2, 4])
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, n in enumerate((5, 40, 90)):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=[7 + (j * 13 + i) % 200 for j in range(n)],
                                          sampling=sp))
    while len(eng.scheduler.running) < 3 or not all(s.spec_token_ids for s in eng.scheduler.running):
        eng.step()
    scheduled = eng.scheduler.schedule()
    batch = spec._attach_drafts(scheduled)
    assert vs.fits(batch) and [n for _, n in batch] == [4, 4, 4]
    bk = vs.static[4]  # three sequences: the 4-bucket, one padding sequence and 12 + 4 rows
    host = np.full(bk.pad.shape, 12345, dtype=np.int64)
    T, blocks = vs.pack(batch, bk, host)
    bk.flat.copy_(torch.from_numpy(host))
    want, fb = eng.runner.build_batch(batch), bk.fb
    assert T == 12 and want.logits_rows.tolist() == list(range(T)) and fb.logits_rows.tolist() == list(range(16))
    pad = torch.from_numpy(bk.pad)
    for name in ("input_ids", "positions", "window_slots", "token_seq"):
        assert getattr(fb, name)[:T].tolist() == getattr(want, name).tolist(), name
        o = bk.fields[name][0]
        assert (getattr(fb, name)[T:] == pad[o + T:o + bk.T]).all(), name
    assert fb.replay_start_t[:3].tolist() == want.replay_start_t.tolist()
    assert fb.state_slot_t[:3].tolist() == want.state_slot_t.tolist() and fb.state_slot_t[3] == eng.cache.scratch_slot
    for name in ("window_tables", "full_tables"):
        got, ref = getattr(fb, name)[:3], getattr(want, name)
        assert got[:, :ref.shape[1]].tolist() == ref.tolist()
    assert (fb.window_tables[3:] == eng.cache.scratch_window).all() and (fb.full_tables[3:] == eng.cache.scratch_full).all()
    for m in vs.ratios:  # the real plan entries first, then padding that writes only the scratch slot
        ref, got = compress_plan(want, m, eng.cache.block_size, eng.cache.scratch_slot + 1), fb.plans[("compress", m)]
        nb = ref.num_blocks
        assert got.blk_seq[:nb].tolist() == ref.blk_seq.tolist() and (got.blk_seq[nb:] == 4).all()
        assert got.blk_entry[:nb].tolist() == ref.blk_entry.tolist()
        assert blocks.get(m, ([], []))[0] == ref.blk_seq.tolist()
        assert got.upd_slot[:len(ref.upd_slot)].tolist() == ref.upd_slot.tolist()
        assert (got.upd_slot[len(ref.upd_slot):] == eng.cache.scratch_slot).all()
        assert got.pend_row[:len(ref.pend_row)].tolist() == ref.pend_row.tolist()
        assert (got.pend_dst[len(ref.pend_dst):] == eng.cache.scratch_slot * m).all()
    # which path: a prefill chunk, more sequences than the largest bucket, or a row without its draft
    seq0, n0 = batch[0]
    assert not VerifySteps(eng.model, eng.cache, 256, spec.k, [2]).fits(batch)
    assert not vs.fits([(seq0, n0 - 1)] + batch[1:])
    seq0.num_computed_tokens -= 1
    assert not vs.fits(batch)
    seq0.num_computed_tokens += 1


@pytest.mark.slow
def test_fused_kernels_take_the_padded_verify_batches(tiny_dir):
    """The kernels the GPU's verify graphs replay (the fused ones, here under the Triton
    interpreter) on the padded batches: the same tokens and acceptance as on the unpadded ones."""
    import kernels

    prompts = _prompts(4000, seed=6, lengths=(7, 21))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs = []
    try:
        kernels.set_backend("fused")
        for padded in (None, [2]):
            llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, speculative_config=SPEC)
            spec = llm.engine.spec
            if padded:
                spec.verify_steps = VerifySteps(llm.engine.model, llm.engine.cache, 128, spec.k, padded)
            runs.append(([o.token_ids for o in llm.generate(prompts, params)], spec.stats()))
    finally:
        kernels.set_backend("auto")
    assert spec.step_paths["verify_graph"] >= 2
    assert runs[0] == runs[1]
