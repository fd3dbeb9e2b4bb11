"""DSpark as a speculative method (engine/spec/dspark.py, docs/DSPARK.md) on tiny 0731 checkpoints:
greedy output equal to plain greedy token for token (batched with requests that do not speculate,
across a preemption and a prefix-cache hit), whole blocks accepted when the drafts replay the
target's own greedy run, the target distribution kept at temperature 1, the config checked."""

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import GenerationRequest, SamplingParams
from tests.engine.conftest import SHAPES
from tests.engine.spec.test_spec_decode import _corrupt, _prompts, _run
from tests.engine.test_batching import _full

DSPARK = {"method": "dspark"}  # k and the threshold from the checkpoint: k = the block (5), threshold 0, gate on
UNGATED = {**DSPARK, "min_acceptance_length": 0}  # every sequence verifies whatever its acceptance


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_spec")
    # the tiny preset's index_topk (4) selects among exactly tied scores in these runs: batched and
    # alone must pick the same entries (kernels.reference.topk_by_score_then_index)
    return {"tiny": write_checkpoint(root / "tiny", "tiny", seed=7, layout="0731"),
            "narrow": write_checkpoint(root / "narrow", "tiny", seed=7, layout="0731", override=SHAPES["narrow-window"]),
            # blocks of 8: a verify of 9 rows closes up to 5 blocks of the ratio-2 CSA
            "block8": write_checkpoint(root / "block8", "tiny", seed=5, layout="0731", override={
                "dspark_block_size": 8, "compress_ratios": [2, 16, 2, 0], "index_topk": 64})}


PROMPTS = _prompts(4096, seed=4, lengths=(3, 9, 17, 22, 30, 38, 47, 51))
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
NO_SPEC = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)  # logprobs: never speculates


@pytest.fixture(scope="module")
def plain(ckpt):
    params = [GREEDY] * 8 + [NO_SPEC] * 2
    return _run(ckpt["tiny"], PROMPTS + PROMPTS[:2], params)[0]


def test_greedy_equals_plain_with_random_and_replayed_drafts(ckpt, plain):
    """8 prompts x 64 tokens, batched with two requests that do not speculate. The random drafter
    (acceptance ~0) with the acceptance gate off (every step verifies, rejects and rolls back) and
    on (as served: after four failed verifies each sequence backs off and decodes plainly, the
    drafter absorbing its rows, probing now and then), and drafts replayed from the plain run with
    the gate on (every block of 5 accepted whole, 6 tokens per verify, across the ratio-4 and -16
    blocks: the gate never engages)."""
    params = [GREEDY] * 8 + [NO_SPEC] * 2
    got, eng = _run(ckpt["tiny"], PROMPTS + PROMPTS[:2], params, speculative_config=UNGATED)
    assert got == plain
    ungated = eng.stats()
    assert ungated["spec_decode_num_drafts"] > 8 * 10 and ungated["spec_decode_num_draft_tokens"] > 2 * ungated["spec_decode_num_drafts"]
    assert ungated["spec_decode_num_backoffs"] == 0
    got, eng = _run(ckpt["tiny"], PROMPTS + PROMPTS[:2], params, speculative_config=DSPARK)
    assert got == plain
    st = eng.stats()
    assert st["spec_decode_num_backoffs"] >= 8 * 3  # each sequence: after the warm-up, then failed probes
    assert st["spec_decode_num_drafts"] < ungated["spec_decode_num_drafts"] / 3
    assert st["spec_decode_num_steps_without_verify"] > 30  # of ~64 decode steps: plain ones, every sequence backed off
    got, eng = _run(ckpt["tiny"], PROMPTS + PROMPTS[:2], params, forced=plain, speculative_config=DSPARK)
    assert got == plain
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["spec_decode_mean_acceptance_length"] > 1 + 0.9 * 5  # whole blocks (shorter near max_tokens)
    assert st["spec_decode_num_backoffs"] == 0
    assert sum(eng.spec.dspark.chosen_lengths.values()) > 0


def test_a_sequence_whose_drafts_recover_resumes_verifying_after_its_backoff(ckpt):
    """Drafts replayed from the plain run but wrong for the first 24 outputs: the sequence backs off
    after its warm-up, its probes fail (backing off twice as long each time) until one lands past
    output 24, accepts the whole block and the sequence verifies whole blocks again."""
    prompts = PROMPTS[2:4]
    want, _ = _run(ckpt["tiny"], prompts, [GREEDY] * 2)
    forced = [[(t + 1) % 4096 for t in w[:24]] + w[24:] for w in want]
    got, eng = _run(ckpt["tiny"], prompts, [GREEDY] * 2, forced, speculative_config=DSPARK)
    assert got == want
    st = eng.stats()
    assert st["spec_decode_num_backoffs"] >= 2 * 2 and st["spec_decode_num_steps_without_verify"] > 10
    counts = st["spec_decode_accepted_length_counts"]  # verifies by accepted drafts
    assert counts[0] >= 2 * 6 and counts[5] >= 2 * 3  # the wrong blocks rejected, then whole blocks accepted


def test_finish_and_abort_while_a_plain_step_is_in_flight(ckpt, plain):
    """Async scheduling: held-back sequences' plain steps stay in flight. One request stops on a
    stop token read back while its next step is in flight (that step's token dropped), another is
    aborted while its token is in flight, a third runs on; the first's output is plain greedy up to
    its stop token, the third's plain greedy, every block freed."""
    stop = plain[0][25]
    assert plain[0].index(stop) == 25  # its first occurrence: inside the third back-off's plain steps
    eng = LLMEngine({"model": str(ckpt["tiny"]), "dtype": "float64", "max_model_len": 256, "async_scheduling": True,
                     "speculative_config": DSPARK})
    for i, sp in enumerate((SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
                            GREEDY, GREEDY)):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=PROMPTS[i], sampling=sp))
    tokens, finished = {"r0": [], "r1": [], "r2": []}, {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids
            if o.finished:
                finished[o.request_id] = (o.finish_reason, eng.pending is not None and any(
                    s.request_id == o.request_id for s, _ in eng.pending.scheduled))
        st = eng.requests.get("r1")
        if st is not None and len(st.seq.output_token_ids) > 30 and st.seq.has_pending_token:
            out = eng.abort("r1")
            tokens["r1"] += out.token_ids
            finished["r1"] = (out.finish_reason, True)
    assert finished["r0"] == ("stop", True)  # its next step was in flight when the stop token came back
    assert tokens["r0"] == plain[0][:26] and tokens["r2"] == plain[2]
    assert finished["r1"] == ("abort", True) and len(tokens["r1"]) > 29 and tokens["r1"] == plain[1][:len(tokens["r1"])]
    assert eng.spec.step_paths["plain_async"] > 20 and _full(eng)


def test_forced_drafts_are_accepted_whole_under_async_scheduling(ckpt, plain):
    """Drafts replayed from the plain run never back off, so no step stays in flight: whole blocks."""
    got, eng = _run(ckpt["tiny"], PROMPTS[:3], [GREEDY] * 3, forced=plain[:3], speculative_config=DSPARK,
                    async_scheduling=True)
    st = eng.stats()
    assert got == plain[:3] and st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["spec_decode_mean_acceptance_length"] > 1 + 0.9 * 5 and eng.spec.step_paths["plain_async"] == 0


def test_greedy_equals_plain_with_chunked_prefill_and_preemption(ckpt):
    prompts = _prompts(4096, seed=1, lengths=(9, 40, 23, 61, 5))
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for _ in prompts]
    kw = dict(max_num_batched_tokens=24, max_num_seqs=5, num_gpu_blocks_override=8)
    want, _ = _run(ckpt["narrow"], prompts, params, **kw)
    got, eng = _run(ckpt["narrow"], prompts, params, [_corrupt(w, 4096) for w in want], speculative_config=DSPARK, **kw)
    assert got == want
    assert eng.scheduler.num_preemptions > 0, "the block budget must force preemption mid-speculation"
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])  # True: held-back plain steps in flight over the hit
def test_prefix_cache_hit_with_bounded_replay(ckpt, async_scheduling):
    """The second request hits the first's cached blocks; bounded replay's rows rebuild the
    drafter's window of main context; greedy tokens equal the plain engine's with the same hit."""
    prefix = _prompts(4096, seed=3, lengths=(40,))[0]
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    outs = []
    for spec in (None, DSPARK):
        llm = LLM(str(ckpt["tiny"]), dtype="float64", max_model_len=256, enable_prefix_caching=True,
                  speculative_config=spec, async_scheduling=async_scheduling)
        first = llm.generate([prefix + [7, 8, 9]], sp)[0].token_ids
        second = llm.generate([prefix + [10, 11]], sp)[0].token_ids
        st = llm.engine.stats()
        assert st["prefix_cache_hits"] == 1 and st["prefix_cache_replayed_tokens"] > 0
        outs.append((first, second))
    assert outs[0] == outs[1]
    assert st["spec_decode_num_drafts"] > 4
    assert (llm.engine.spec.step_paths["plain_async"] > 4) == async_scheduling


def test_cached_context_keys_draft_as_the_main_context_rows(ckpt):
    """The proposer keeps every stage's keys per position (computed once, when the features come),
    in its key ring, a window (8 here) per state slot: a prefill chunk longer than the window, verify
    steps that wrap the ring, rejected positions rewritten with other features. Its drafts equal
    those of the keys recomputed from the main context rows of the window's final features."""
    eng = LLM(str(ckpt["narrow"]), dtype="float64", max_model_len=256, speculative_config=DSPARK).engine
    eng.add_request(GenerationRequest("r", prompt_token_ids=list(range(5, 25)), sampling=GREEDY))
    eng.step()  # the prefill: the sequence holds a state slot (its keys are rewritten below)
    prop, drafter, seq = eng.spec.dspark, eng.spec.dspark.drafter, eng.requests["r"].seq
    W, g, slot = prop.window, torch.Generator().manual_seed(0), seq.blocks.state_slot
    truth = torch.zeros(64, len(eng.cfg.dspark.target_layer_ids) * eng.cfg.hidden_size, dtype=torch.float64)
    for start, n in [(0, 20), (20, 6), (23, 6), (29, 6), (31, 3)]:  # 23, 31: run again (a replay)
        feats = torch.randn(n, truth.shape[1], generator=g, dtype=torch.float64)
        truth[start:start + n] = feats
        prop.absorb([(seq, start, [7] * n)], feats)
    want = torch.arange(35 - W, 35)
    assert prop.positions[slot, want % W].tolist() == want.tolist()
    cached = drafter.draft_from_ring(eng.model, prop.ring, *(torch.tensor([v]) for v in (slot, 35, 11)), 0.0)
    direct = drafter.draft(eng.model, [(drafter.main_context(truth[want]), want)], [11], 0.0)
    assert torch.equal(cached.tokens, direct.tokens)
    torch.testing.assert_close(cached.confidence, direct.confidence, rtol=1e-10, atol=1e-10)


def test_confidence_threshold_caps_the_verify_length(ckpt):
    """Threshold 1: no block is predicted accepted with certainty, not even its first draft, so none
    is verified: every step after the prefill is a plain one (the drafter still drafts and absorbs)."""
    prompts = PROMPTS[:2]
    want, _ = _run(ckpt["tiny"], prompts, [GREEDY] * 2)
    got, eng = _run(ckpt["tiny"], prompts, [GREEDY] * 2, speculative_config={**DSPARK, "confidence_threshold": 1.0})
    st = eng.stats()
    assert got == want and st["spec_decode_num_drafts"] == 0 and st["spec_decode_num_backoffs"] == 0
    assert set(eng.spec.dspark.chosen_lengths) == {0} and st["spec_decode_num_confidence_skips"] > 2 * 60
    assert st["spec_decode_num_steps_without_verify"] >= 64


def test_sampled_tokens_keep_the_target_distribution(ckpt):
    """As test_spec_decode's MTP version: 500 requests at temperature 1 (top_k 2: 8 joint outcomes of
    three tokens), drafts replayed from the greedy run (both the accept and the resample paths),
    against the plain engine's exact joint distribution, chi-square at p 1e-4 with the engine's seed."""
    from tests.engine.spec.test_rejection_sampler import P_VALUE, chi_square_p
    from tests.engine.spec.test_spec_decode import _exact_joint

    n, prompt = 500, [11, 523, 77, 1200, 9]
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    joint = _exact_joint(ckpt["tiny"], prompt, sp, 4096)
    greedy = LLM(str(ckpt["tiny"]), dtype="float32", max_model_len=64).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(str(ckpt["tiny"]), dtype="float32", max_model_len=64, max_num_seqs=128, seed=0,
              speculative_config={**DSPARK, "num_speculative_tokens": 2})
    llm.engine.spec.force_drafts({f"offline-{i}": greedy for i in range(n)})
    outs = [tuple(o.token_ids) for o in llm.generate([prompt] * n, sp)]
    st = llm.engine.stats()
    assert st["spec_decode_num_drafts"] >= n and 0.1 < st["spec_decode_acceptance_rate"] < 0.9
    assert all(o in joint for o in outs), "a token outside the target's top-k was emitted"
    cells = list(joint)
    counts = torch.tensor([outs.count(c) for c in cells])
    assert chi_square_p(counts, torch.tensor([joint[c] for c in cells])) > P_VALUE


def _wrong_after_gaps(tokens, vocab, gaps=range(1, 10)):
    """The outputs with wrong tokens at 1, 1 + 2, 1 + 2 + 3, ...: the first verify drafts from
    output 1 on, and after each rejection the next one drafts just past the wrong token, so
    the verifies accept 0, 1, 2, ... drafts (every offset of the block)."""
    out, at = list(tokens), 0
    for g in gaps:
        at += g
        if at < len(out):
            out[at] = (out[at] + 1) % vocab
    return out


def test_whole_blocks_of_8_and_every_partial_acceptance_across_small_ratios(ckpt):
    """Blocks of 8 on ratios 2 (CSA) and 16 (HCA): a verify closes several blocks per compressor.
    Drafts replayed from the plain run are accepted whole; drafts wrong after every gap of 1..9
    accept every count 0..8 and the rollback reopens the block of the first rejected position
    (its overlap state from a block the same verify closed, or from before it)."""
    prompts = _prompts(4096, seed=6, lengths=(5, 19, 34))
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * 3
    want, _ = _run(ckpt["block8"], prompts, params)
    got, eng = _run(ckpt["block8"], prompts, params, want, speculative_config=DSPARK)
    assert got == want and eng.spec.k == 8
    st = eng.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["spec_decode_mean_acceptance_length"] > 1 + 0.8 * 8
    got, eng = _run(ckpt["block8"], prompts, params, [_wrong_after_gaps(w, 4096) for w in want],
                    speculative_config=DSPARK)
    assert got == want
    assert all(eng.stats()["spec_decode_accepted_length_counts"]), "every acceptance count 0..8 happens"


@pytest.mark.parametrize("spec, message", [
    ({"method": "dspark", "num_speculative_tokens": 6}, "num_speculative_tokens=6 exceeds the checkpoint's dspark_block_size \\(5\\)"),
    ({"method": "dspark", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in \\[1, 16\\]"),
    ({"method": "dspark", "confidence_threshold": 1.5}, "confidence_threshold must be a number in \\[0, 1\\]"),
    ({"method": "mtp", "num_speculative_tokens": 1, "confidence_threshold": 0.5}, "unsupported key.*confidence_threshold"),
    ({"method": "dspark", "min_acceptance_length": -1}, "min_acceptance_length must be a number in \\[0, 17\\]"),
    ({"method": "dspark", "backoff_steps": 0}, "backoff_steps must be a positive integer"),
    ({"method": "dspark", "backoff_steps": 8, "max_backoff_steps": 4}, "max_backoff_steps must be an integer >= backoff_steps \\(8\\)"),
])
def test_bad_dspark_config_is_refused_naming_it(ckpt, spec, message):
    with pytest.raises(InvalidEngineArgs, match=message):
        LLMEngine({"model": str(ckpt["tiny"]), "speculative_config": spec})


def test_dspark_needs_the_0731_layout_and_mtp_the_preview_one(ckpt, tiny_dir):
    with pytest.raises(InvalidEngineArgs, match="method 'dspark' needs a checkpoint with DSpark draft stages"):
        LLMEngine({"model": str(tiny_dir), "speculative_config": DSPARK})
    with pytest.raises(Exception, match="ships 3 DSpark draft stages"):
        LLMEngine({"model": str(ckpt["tiny"]), "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}})
