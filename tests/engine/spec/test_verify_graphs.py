"""Speculative decoding's verify steps through the padded, fixed-shape batches that the verify
CUDA graphs replay (engine/spec/verify_graphs.py). On the CPU the same padded batches run eagerly
through the function the graphs capture, so these tests compare them with the unpadded eager
verify: the same tokens (greedy and sampled: the same logits draw the same samples), the same
acceptance counts (the rollback reads the graph's closed-block and overlap-state buffers), and
which steps took which path."""

import pytest
import torch

from engine.llm import LLM
from engine.request import GenerationRequest, SamplingParams
from engine.spec.draft_graphs import DraftGraphs
from engine.spec.verify_graphs import VerifyGraphs
from tests.engine.test_batching import _full

SPEC = {"method": "mtp", "num_speculative_tokens": 5}  # 6 rows: up to 2 closed blocks of ratio 4
pytestmark = [pytest.mark.usefixtures("single_thread")]


def _prompts(vocab, seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (L,), generator=g).tolist() for L in lengths]


def _padded(eng, buckets):
    """What the GPU captures (verify and MTP graphs), as static batches run eagerly."""
    spec = eng.spec
    assert spec.verify_steps is None and spec.draft_steps is None  # CPU: no decode graphs, so none
    spec.verify_steps = VerifyGraphs(eng.model, eng.cache, eng.max_model_len, spec.k, buckets)
    spec.draft_steps = DraftGraphs(spec.mtp, eng.model, spec.mtp_cache, spec.verify_steps)


def _run(path, prompts, params, padded, forced=None, **kw):
    llm = LLM(str(path), dtype="float64", max_model_len=256, speculative_config=SPEC, seed=3, **kw)
    spec = llm.engine.spec
    if padded:
        _padded(llm.engine, padded)
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
    assert paths["verify_graph"] + paths["verify_eager"] == e_eng.spec.step_paths["verify_eager"]
    assert paths["verify_graph"] == p_eng.spec.verify_steps.replays == paths["draft_graph"]
    assert p_eng.spec.verify_steps.rollback.replays > 0  # rejected drafts closed blocks in padded steps too
    assert paths["draft_graph"] + paths["draft_eager"] == e_eng.spec.step_paths["draft_eager"]


@pytest.mark.parametrize("shape", ["tiny", "official-ratios"])
def test_padded_mtp_drafts_equal_the_eager_drafts_at_every_step(checkpoints, shape):
    """The MTP's own drafts (catch-up over every verify row, chained steps on the device) against
    the eager MTP path, compared after every step. The verified drafts are forced to the plain
    tokens with every third one wrong, so the MTP drafts from every accepted row; sequences near
    max_tokens draft fewer."""
    path = checkpoints[shape]
    prompts = _prompts(4000, seed=8, lengths=(9, 30, 17))
    params = [SamplingParams(max_tokens=9 + 2 * i, temperature=0, ignore_eos=True) for i in range(3)]
    plain = [o.token_ids for o in LLM(str(path), dtype="float64", max_model_len=256).generate(prompts, params)]
    engines = []
    for padded in (None, [1, 2, 4]):
        eng = LLM(str(path), dtype="float64", max_model_len=256, speculative_config=SPEC).engine
        if padded:
            _padded(eng, padded)
        eng.spec.force_drafts({f"r{i}": _corrupt(p, 4000) for i, p in enumerate(plain)})
        for i, p in enumerate(prompts):
            eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=params[i]))
        engines.append(eng)
    drafts = 0
    while engines[0].has_unfinished():
        outs = [[(o.request_id, o.token_ids) for o in eng.step()] for eng in engines]
        assert outs[0] == outs[1]
        assert engines[0].spec.mtp_drafts == engines[1].spec.mtp_drafts
        drafts += sum(map(len, engines[0].spec.mtp_drafts.values()))
    assert not engines[1].has_unfinished() and drafts > 20
    assert engines[0].spec.stats()["spec_decode_num_accepted_tokens_per_pos"][1] > 0  # drafts from rows 0, 1 and 2
    assert engines[1].spec.step_paths["draft_graph"] > 3 and engines[1].spec.stats() == engines[0].spec.stats()


@pytest.mark.slow
def test_fused_kernels_on_the_emulated_verify_and_mtp_graphs_equal_the_eager_path(kernels_tiny_dir):
    """The kernels the GPU's verify and MTP graphs replay (the fused ones, here under the Triton
    interpreter) two ways in step: on the unpadded batches, and on the padded batches captured and
    replayed through the CPU emulation of CUDA graphs (tests/engine/graphs/graph_emulation.py: host
    values baked in at capture on the all-padding batch, allocations poisoned at each replay, host
    reads refused); the prompts' prefill before them on the references (other tests run prefills on
    the kernels; here it would be 40% of the interpreter's time). Every step the same tokens and the
    same MTP drafts both ways; at the end the same acceptance, and the tokens of plain decoding. The
    verified drafts are forced with every third one wrong, so rollbacks and accepted rows both run.
    (The padded batches run eagerly are not a third way here: a replay reruns exactly the kernels that
    run made, with the capture's host values, and the GPU never runs them eagerly;
    test_padded_verify_equals_the_eager_verify runs them on the references. About a minute of CPU.)"""
    import kernels
    from tests.engine.graphs.graph_emulation import capture

    prompts = _prompts(4000, seed=6, lengths=(7, 21))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(kernels_tiny_dir), dtype="float32", max_model_len=128).generate(prompts, params)]
    engines, tokens = [], {f"r{i}": [] for i in range(len(prompts))}
    try:
        for how in ("unpadded", "emulated"):
            eng = LLM(str(kernels_tiny_dir), dtype="float32", max_model_len=128, speculative_config=SPEC).engine
            kernels.set_backend("fused")  # after the engine, which sets its `kernels` argument's backend
            spec = eng.spec
            if how == "emulated":
                spec.verify_steps = VerifyGraphs(eng.model, eng.cache, 128, spec.k, [2], "emulated", capture)
                spec.draft_steps = DraftGraphs(spec.mtp, eng.model, spec.mtp_cache, spec.verify_steps, "emulated", capture)
            spec.force_drafts({f"r{i}": _corrupt(p, 4000) for i, p in enumerate(plain)})
            for i, p in enumerate(prompts):
                eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=params))
            engines.append(eng)
        kernels.set_backend("ref")  # the prompts' prefill (one eager step, the heaviest) on the references
        while engines[0].has_unfinished():
            outs = [[(o.request_id, o.token_ids) for o in eng.step()] for eng in engines]
            kernels.set_backend("fused")  # every verify and MTP step after it on the kernels
            assert outs[0] == outs[1]
            assert engines[0].spec.mtp_drafts == engines[1].spec.mtp_drafts
            for rid, ids in outs[0]:
                tokens[rid] += ids
    finally:
        kernels.set_backend("auto")
    assert not any(eng.has_unfinished() for eng in engines) and list(tokens.values()) == plain
    unpadded, spec = (eng.spec for eng in engines)
    # eager: the prefill, only; every other step a replay
    assert spec.step_paths["verify_eager"] == unpadded.step_paths["verify_eager"] - spec.step_paths["verify_graph"] == 1
    assert spec.step_paths["verify_graph"] >= 2 and spec.step_paths["draft_graph"] >= 2
    assert spec.verify_steps.rollback.replays >= 1
    assert spec.verify_steps.static[2].graph.replays == spec.step_paths["verify_graph"]
    assert spec.draft_steps.static[2].graph.replays == spec.step_paths["draft_graph"]
    assert spec.verify_steps.rollback.static[2].graph.replays == spec.verify_steps.rollback.replays
    stats = unpadded.stats()
    assert spec.stats() == stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
