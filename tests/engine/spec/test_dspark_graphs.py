"""DSpark's drafter graphs (engine/spec/dspark_graphs.py) without a GPU, on tiny 0731 checkpoints, in
step with the eager path: the verify and drafter graphs' static batches run eagerly ("padded": the
same tokens and the same own drafts every step, batched with a request that does not speculate,
across a preemption, greedy output equal to plain greedy), and the drafter's graph captured and
replayed through the CPU emulation of CUDA graphs ("emulated")."""

import pytest
import torch

from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import GenerationRequest, SamplingParams
from engine.spec.decoder import DSparkStepGraphs
from engine.spec.dspark_graphs import DSparkGraphs
from engine.spec.plain_graphs import PlainStepGraphs
from engine.spec.verify_graphs import VerifyGraphs
from tests.engine.conftest import SHAPES
from tests.engine.spec.test_dspark import DSPARK, _wrong_after_gaps
from tests.engine.spec.test_spec_decode import _prompts
from tests.engine.test_batching import _full

pytestmark = [pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def narrow_0731(tmp_path_factory):
    """A window of 8 (the key ring wraps within a few steps), ratios 4 and 32."""
    return write_checkpoint(tmp_path_factory.mktemp("dspark_graphs"), "tiny", seed=7, layout="0731",
                            override=SHAPES["narrow-window"])


@pytest.fixture(scope="module")
def tiny_0731(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspark_graphs"), "tiny", seed=7, layout="0731")


def _padded(eng, buckets, emulate=(), capture_fn=None):
    """What the GPU captures for DSpark (engine/spec/decoder.py's dspark_graphs): the verify graphs
    with the target features, the plain decode step's graph with them (on the runner's static decode
    batches) and the drafter's graphs after each. Their static batches run eagerly, except the sets
    named in `emulate` ("plain", "draft"), captured through `capture_fn` (the verify graphs' capture
    is the verify graph tests' business: tests/engine/spec/test_verify_graphs.py)."""
    spec = eng.spec
    assert spec.verify_steps is None and spec.draft_steps is None  # CPU: no decode graphs, so none
    eng.runner.static_decode_batches(buckets)
    cap = lambda name: {"pool": "emulated", "capture_fn": capture_fn} if name in emulate else {}
    verify = VerifyGraphs(eng.model, eng.cache, eng.max_model_len, spec.k, buckets, features=True)
    plain = PlainStepGraphs(eng.runner, buckets, **cap("plain"))
    spec.use_dspark_graphs(DSparkStepGraphs(verify, DSparkGraphs(spec.dspark, eng.model, verify, **cap("draft")), plain,
                                            DSparkGraphs(spec.dspark, eng.model, plain, **cap("draft"))))


@pytest.mark.parametrize("drafts", ["gaps", "own"])
def test_padded_drafter_steps_equal_the_eager_steps(narrow_0731, drafts):
    """Four greedy requests and one that never speculates (logprobs), a block budget that forces a
    preemption (the recompute runs eagerly, then graph steps again, maybe in another state slot).
    gaps: the verified drafts are forced to the plain tokens wrong after every gap (every acceptance
    count, so every number of accepted rows' keys written through the graph's ring rows). own: the
    random drafter's own drafts under the acceptance gate: after the warm-up, steps that verify
    nothing replay the plain step's graph and the drafter's graph after it (keys only while every
    sequence backs off), probes replay the verify graphs. The drafter's own drafts (what it proposed
    before forcing) compared after every step."""
    prompts = _prompts(4096, seed=1, lengths=(9, 40, 23, 61, 5))
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4 + \
             [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)]
    kw = dict(dtype="float64", max_model_len=256, max_num_batched_tokens=48, max_num_seqs=5, num_gpu_blocks_override=8)
    plain = [o.token_ids for o in LLM(str(narrow_0731), **kw).generate(prompts, params)]
    engines = []
    for padded in (None, [2, 4, 8]):
        eng = LLM(str(narrow_0731), speculative_config=DSPARK, **kw).engine
        if padded:
            _padded(eng, padded)
        if drafts == "gaps":
            eng.spec.force_drafts({f"r{i}": _wrong_after_gaps(p, 4096, gaps=range(1, 7)) for i, p in enumerate(plain)})
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=sp))
        engines.append(eng)
    tokens, drafted = {f"r{i}": [] for i in range(len(prompts))}, 0
    while engines[0].has_unfinished():
        outs = [[(o.request_id, o.token_ids) for o in eng.step()] for eng in engines]
        assert outs[0] == outs[1]
        assert engines[0].spec.mtp_drafts == engines[1].spec.mtp_drafts
        drafted += sum(map(len, engines[0].spec.mtp_drafts.values()))
        for rid, ids in outs[0]:
            tokens[rid] += ids
    eager, padded = engines
    assert not padded.has_unfinished() and _full(padded) and list(tokens.values()) == plain
    assert drafted > 40 and padded.scheduler.num_preemptions > 0
    paths, spec = padded.spec.step_paths, padded.spec
    assert paths["draft_eager"] > 0  # steps with prefill chunks (the recompute's too)
    assert spec.stats() == eager.spec.stats()
    if drafts == "gaps":
        assert paths["draft_graph"] == paths["verify_graph"] == spec.draft_steps.replays > 8
        assert spec.verify_steps.rollback.replays > 3  # rejected drafts reopened blocks in graph steps
        assert all(spec.stats()["spec_decode_accepted_length_counts"][:5])
    else:
        assert spec.stats()["spec_decode_num_backoffs"] >= 4 and paths["verify_graph"] > 4  # warm-ups, probes
        assert paths["plain_graph"] == spec.plain_steps.replays == spec.plain_draft_steps.replays > 10
        assert spec.plain_draft_steps.keys_replays > 5  # every sequence backed off: the keys only
        assert paths["draft_graph"] == paths["verify_graph"] + paths["plain_graph"]


def test_emulated_drafter_graph_replays_what_the_eager_drafter_drafts(tiny_0731, monkeypatch):
    """DSpark's drafter graph captured through the CPU emulation of CUDA graphs
    (tests/engine/graphs/graph_emulation.py) on the all-padding batch, as the GPU captures it: host
    values baked in, host reads refused, allocations poisoned at each replay. Its MoE on the fused
    kernel (the reference counts each expert's rows on the host, which no graph can; the
    interpreter runs it, so one small bucket and one replay). The replayed step (one sequence
    accepting two forced drafts, the other all five) writes the keys and drafts what the eager
    proposer does."""
    import kernels
    from kernels.fused import FUSED
    from tests.engine.graphs.graph_emulation import capture

    def capture_with_fused_moe(run, pool):
        with monkeypatch.context() as m:
            m.setattr(kernels, "router_moe", FUSED["router_moe"])
            return capture(run, pool)

    prompts = _prompts(4096, seed=2, lengths=(21, 34))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_0731), dtype="float32", max_model_len=128).generate(prompts, params)]
    forced = {"r0": plain[0][:3] + [(plain[0][3] + 1) % 4096] + plain[0][4:], "r1": plain[1]}
    engines = []
    for emulated in (False, True):
        eng = LLM(str(tiny_0731), dtype="float32", max_model_len=128, speculative_config=DSPARK).engine
        if emulated:
            _padded(eng, [2], ("draft",), capture_with_fused_moe)
        eng.spec.force_drafts(forced)
        for i, p in enumerate(prompts):
            eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=params))
        engines.append(eng)
    for _ in range(2):  # the prefill (eager), then a verify step and the drafter graph's replay
        outs = [[(o.request_id, o.token_ids) for o in eng.step()] for eng in engines]
        assert outs[0] == outs[1]
        assert engines[0].spec.mtp_drafts == engines[1].spec.mtp_drafts and len(engines[0].spec.mtp_drafts) == 2
    spec = engines[1].spec
    assert spec.draft_steps.static[2].graph.replays == spec.step_paths["draft_graph"] == 1
    assert spec.stats()["spec_decode_accepted_length_counts"] == [0, 0, 1, 0, 0, 1] == engines[0].spec.stats()[
        "spec_decode_accepted_length_counts"]
    W = spec.dspark.window
    ring = [eng.spec.dspark.ring[:-W] for eng in engines]  # the sequences' slots (the scratch slot's last)
    torch.testing.assert_close(ring[1], ring[0], rtol=1e-5, atol=1e-5)


def test_emulated_plain_step_graph_replays_what_the_eager_step_does(tiny_0731, monkeypatch):
    """Steps that verify nothing (the confidence threshold 1: every block gated to no draft) replay
    the plain decode step's graph with the target features and then DSpark's drafter graph after it,
    both captured through the CPU emulation of CUDA graphs (the fused MoE and paged attention, whose
    references read the host; one bucket, four tokens): the
    tokens equal plain greedy and the eager engine's, the drafts and every stored key equal eager."""
    import kernels
    from kernels.fused import FUSED
    from tests.engine.graphs.graph_emulation import capture

    HOST_READING = ("router_moe", "paged_attention")  # references that read the host; the rest stay torch

    def capture_fused(run, pool):
        with monkeypatch.context() as m:
            for name in HOST_READING:
                m.setattr(kernels, name, FUSED[name])
            return capture(run, pool)

    prompts = _prompts(4096, seed=2, lengths=(21, 34))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_0731), dtype="float32", max_model_len=64).generate(prompts, params)]
    engines = []
    for emulated in (False, True):
        eng = LLM(str(tiny_0731), dtype="float32", max_model_len=64,
                  speculative_config={**DSPARK, "confidence_threshold": 1.0}).engine
        if emulated:
            _padded(eng, [2], ("plain", "draft"), capture_fused)
        for i, p in enumerate(prompts):
            eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=params))
        engines.append(eng)
    tokens = {"r0": [], "r1": []}
    while engines[0].has_unfinished():
        outs = [[(o.request_id, o.token_ids) for o in eng.step()] for eng in engines]
        assert outs[0] == outs[1]
        assert engines[0].spec.mtp_drafts == engines[1].spec.mtp_drafts
        for rid, ids in outs[0]:
            tokens[rid] += ids
    assert list(tokens.values()) == plain
    spec = engines[1].spec
    assert spec.plain_steps.static[2].graph.replays == spec.step_paths["plain_graph"] == 3  # after the prefill
    # after the first plain step both draft (blocks of one: room for one more token; gated to nothing),
    # after the others nobody has room: the keys only
    bucket = spec.plain_draft_steps.static[2]
    assert (bucket.graph.replays, bucket.keys_only.graph.replays, spec.verify_steps.replays) == (1, 2, 0)
    st = spec.stats()
    assert st["spec_decode_num_drafts"] == 0 and st["spec_decode_num_confidence_skips"] == 2 * 2  # the prefill's and the first plain step's
    assert st["spec_decode_num_steps_without_verify"] == 4 == engines[0].spec.stats()["spec_decode_num_steps_without_verify"]
    W = spec.dspark.window
    ring = [eng.spec.dspark.ring[:-W] for eng in engines]
    torch.testing.assert_close(ring[1], ring[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded", [None, [2, 4]])
def test_held_back_plain_steps_stay_in_flight_under_async_scheduling(narrow_0731, padded):
    """Async scheduling, the random drafter's own drafts under the acceptance gate: once every
    speculating sequence is held back, steps that verify nothing stay in flight (plain_async: the
    plain step's graph on the static batches and the drafter's keys-only graph after it, or
    eagerly), the next step reading their tokens on the device; the probes after them (a step that
    drafts, then a verify) read them back first and verify. Three speculating requests and a seeded
    one (never speculates, stays in flight with them), a block budget that forces a preemption.
    Output equal to plain greedy."""
    prompts = _prompts(4096, seed=1, lengths=(9, 40, 23, 30))
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, seed=3)]
    kw = dict(dtype="float64", max_model_len=256, max_num_batched_tokens=48, max_num_seqs=4, num_gpu_blocks_override=8)
    plain = [o.token_ids for o in LLM(str(narrow_0731), **kw).generate(prompts, params)]
    eng = LLM(str(narrow_0731), speculative_config=DSPARK, async_scheduling=True, **kw).engine
    if padded:
        _padded(eng, padded)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=sp))
    tokens, verifies_after_flight = {f"r{i}": [] for i in range(len(prompts))}, None
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids
        if verifies_after_flight is None and eng.pending is not None and eng.spec.step_paths["plain_async"]:
            verifies_after_flight = eng.stats()["spec_decode_num_drafts"]
    assert list(tokens.values()) == plain and _full(eng) and eng.scheduler.num_preemptions > 0
    spec, st = eng.spec, eng.stats()
    paths = spec.step_paths
    assert paths["plain_async"] > 25 and st["spec_decode_num_drafts"] > verifies_after_flight  # probes verified
    if padded:
        assert paths["plain_graph"] == spec.plain_steps.replays == spec.plain_draft_steps.replays > paths["plain_async"]
        assert spec.plain_draft_steps.keys_replays >= paths["plain_async"]
    else:
        assert paths["plain_graph"] == 0
