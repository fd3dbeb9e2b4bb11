"""The DSpark drafter's torch reference (engine/models/deepseek_v4/dspark_reference.py), piece by
piece: the target features against transformers' own layers, the block's attention mask (window
and bidirectional block, seen through the whole drafter), the Markov head, the confidence head
and the verify length it picks. Float64 on the tiny 0731 checkpoint."""

import dataclasses

import pytest
import torch

from engine.cache import KVCache
from engine.models.deepseek_v4 import dspark_reference as ref
from engine.models.deepseek_v4.dspark import DSparkDrafter
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.sequence import Sequence
from tests.engine.conftest import reference_model

IDS = list(range(100, 140))  # 40 tokens: past the tiny preset's window (16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspark_ref"), "tiny", seed=3, layout="0731")


@pytest.fixture(scope="module")
def loaded(ckpt):
    model = load_model(ckpt, torch.float64)
    drafter = DSparkDrafter.from_model(model)
    cache = KVCache(model.cfg, 16, 64, 64, 2, torch.float64)
    seq = Sequence("t", list(IDS), SamplingParams())
    cache.allocate(seq.blocks, 0, len(IDS))
    fb = ModelRunner(model, cache).build_batch([(seq, len(IDS))])
    _, features = model.dspark_features(fb, cache)
    return model, drafter, features


def test_target_features_are_transformers_layer_outputs(ckpt, loaded):
    """The mean over the residual copies after each target layer, concatenated in target order."""
    model, _, features = loaded
    oracle = reference_model(ckpt, torch.float64)
    outs = {}
    for i in model.cfg.dspark.target_layer_ids:
        oracle.model.layers[i].register_forward_hook(lambda m, a, o, i=i: outs.setdefault(i, o))
    with torch.no_grad():
        oracle(torch.tensor([IDS]))
    want = torch.cat([outs[i][0].mean(dim=1) for i in model.cfg.dspark.target_layer_ids], dim=-1)
    assert features.shape == (len(IDS), 3 * model.cfg.hidden_size)
    torch.testing.assert_close(features, want, rtol=1e-9, atol=1e-9)


def test_mask_is_the_last_window_of_context_and_the_whole_block():
    context, allowed = ref.attention_allowed(block_start=40, block_size=5, window=16)
    assert context.tolist() == list(range(24, 40)) and allowed.shape == (5, 21) and allowed.all()
    context, allowed = ref.attention_allowed(block_start=3, block_size=5, window=16)
    assert context.tolist() == [0, 1, 2] and allowed.shape == (5, 8)


def test_drafter_reads_only_the_window_and_sees_the_whole_block(loaded):
    """Through the whole drafter: a context position just outside the window changes nothing, one
    just inside changes the drafts' logits; the first position's logits depend on the noise token
    at the later positions (the block is bidirectional, not causal)."""
    model, drafter, features = loaded
    W, t1 = model.cfg.sliding_window, features.shape[0]
    base = ref.draft_block(model, drafter, features, last_token=7)
    for pos, changes in ((t1 - W - 1, False), (t1 - W, True)):
        f = features.clone()
        f[pos] += 1.0
        got = ref.draft_block(model, drafter, f, last_token=7).logits
        assert (not torch.equal(got, base.logits)) == changes, pos
    cfg = drafter.cfg
    drafter.cfg = dataclasses.replace(cfg, dspark=dataclasses.replace(cfg.dspark, noise_token_id=5))
    try:
        other = ref.draft_block(model, drafter, features, last_token=7)
    finally:
        drafter.cfg = cfg
    assert not torch.allclose(other.logits[0], base.logits[0])


def test_markov_head_biases_each_position_by_the_token_drafted_before_it():
    g = torch.Generator().manual_seed(0)
    V, r, B = 50, 6, 5
    base = torch.randn(B, V, generator=g, dtype=torch.float64)
    w1, w2 = torch.randn(V, r, generator=g, dtype=torch.float64), torch.randn(V, r, generator=g, dtype=torch.float64)
    tokens, logits, embeds = ref.markov_draft(base, 3, w1, w2)
    prev = [3] + tokens[:-1]
    torch.testing.assert_close(logits, base + w1[prev] @ w2.T)
    torch.testing.assert_close(embeds, w1[prev])
    assert tokens == logits.argmax(-1).tolist()
    # a bigram head strong enough to decide (bias 100 on nxt[prev]): the drafts follow its chain from the real token
    nxt = torch.randperm(V, generator=g)
    bigram = 100 * torch.eye(V, dtype=torch.float64)[nxt].T  # column p: 100 at row nxt[p]
    chain, _, _ = ref.markov_draft(base, 3, torch.eye(V, dtype=torch.float64), bigram)
    want = [int(nxt[3])]
    while len(want) < B:
        want.append(int(nxt[want[-1]]))
    assert chain == want
    zero_tokens, _, _ = ref.markov_draft(base, 3, w1, torch.zeros(V, r, dtype=torch.float64))
    assert zero_tokens == base.argmax(-1).tolist()  # no bias: each position its own argmax


def test_confidence_head_and_verify_length():
    g = torch.Generator().manual_seed(1)
    proj, hidden, emb = (torch.randn(1, 12, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
    got = ref.confidence_logits(proj, hidden, emb)
    torch.testing.assert_close(got, torch.cat([hidden, emb], -1) @ proj[0])
    logits = torch.logit(torch.tensor([0.9, 0.8, 0.5, 0.9, 0.9], dtype=torch.float64))
    # survival 0.9, 0.72, 0.36, 0.324, 0.2916
    assert [ref.verify_length(logits, th) for th in (0.0, 0.3, 0.35, 0.5, 0.8, 0.95, 1.0)] == [5, 4, 3, 2, 1, 1, 1]


def test_drafter_drafts_a_block_and_picks_its_verify_length(loaded):
    model, drafter, features = loaded
    out = ref.draft_block(model, drafter, features, last_token=IDS[-1], threshold=0.0)
    B = model.cfg.dspark.block_size
    assert len(out.tokens) == B and out.logits.shape == (B, model.cfg.vocab_size) and out.verify_len == B
    assert out.tokens == out.logits.argmax(-1).tolist()
    assert ref.draft_block(model, drafter, features, IDS[-1], threshold=1.0).verify_len == 1


def test_engine_drafter_equals_the_reference(loaded):
    """DSparkDrafter.draft (batched, the kernels' ops) vs the reference, two sequences at once with
    different context lengths (one shorter than the window)."""
    model, drafter, features = loaded
    W = model.cfg.sliding_window
    cases = [(len(IDS), 11), (9, 2000)]  # (context length t + 1, last token)
    contexts = []
    for t1, _ in cases:
        pos = torch.arange(max(0, t1 - W), t1)
        contexts.append((drafter.main_context(features[pos]), pos))
    got = drafter.draft(model, contexts, [tok for _, tok in cases], threshold=0.5)
    for s, (t1, tok) in enumerate(cases):
        want = ref.draft_block(model, drafter, features[:t1], tok, threshold=0.5)
        assert got.tokens[s].tolist() == want.tokens
        # mHC mixes in fp32 in both (kernels/reference.py), batched here, one sequence there
        torch.testing.assert_close(got.confidence[s], want.confidence, rtol=1e-6, atol=1e-6)
        assert got.verify_len[s] == want.verify_len


def test_drafter_kept_as_stored_equals_the_dequantized_one(tmp_path):
    """The FP8 / MXFP4 stages kept as stored (the CUDA default) and dequantized at load (the CPU's):
    the same drafts from the same features (the torch references dequantize inside each op)."""
    path = write_checkpoint(tmp_path, "tiny", seed=5, quant="fp8-fp4", layout="0731")
    out = []
    for quantized in (False, True):
        model = load_model(path, torch.float32, quantized=quantized)
        drafter = DSparkDrafter.from_model(model)
        assert drafter.stages[1].attn.wq_b.weight.dtype == (torch.float8_e4m3fn if quantized else torch.float32)
        assert drafter.main_proj.weight.dtype == (torch.float8_e4m3fn if quantized else torch.float32)
        g = torch.Generator().manual_seed(0)
        features = torch.randn(20, 3 * model.cfg.hidden_size, generator=g)
        pos = torch.arange(4, 20)
        out.append(drafter.draft(model, [(drafter.main_context(features[pos]), pos)], [42], 0.0))
    assert torch.equal(out[0].tokens, out[1].tokens)
    torch.testing.assert_close(out[0].confidence, out[1].confidence, rtol=1e-4, atol=1e-4)


def test_drafter_on_the_fused_kernels_equals_the_references(tmp_path):
    """The GPU's path: stages as stored, every fused kernel on (the interpreter on the CPU), float32."""
    import kernels

    model = load_model(write_checkpoint(tmp_path, "tiny", seed=5, quant="fp8-fp4", layout="0731"), torch.float32,
                       quantized=True)
    drafter = DSparkDrafter.from_model(model)
    features = torch.randn(20, 3 * model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(4, 20)

    def draft():
        return drafter.draft(model, [(drafter.main_context(features[pos]), pos),
                                     (drafter.main_context(features[pos[8:]]), pos[8:])], [42, 7], 0.0)

    want = draft()
    try:
        kernels.set_backend("fused")
        assert kernels.hc_pre.__module__.startswith("kernels.fused")
        got = draft()
    finally:
        kernels.set_backend("auto")
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-4, atol=1e-4)
