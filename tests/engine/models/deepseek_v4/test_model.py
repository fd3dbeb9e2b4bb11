"""The native DeepSeek-V4 network against transformers' DeepseekV4ForCausalLM (the oracle).

Float64 on both sides (the reference itself runs norms, mHC and softmaxes in fp32, which
bounds agreement near 1e-6); tolerance: max |logit error| <= 1e-4 x max |logit|. Quantized
checkpoints (FP8 linears, FP8 or MXFP4 experts) use the same tolerance: transformers'
FineGrainedFP8Config(dequantize=True) and the engine's CPU load both dequantize to the same
values (e4m3 / e2m1 times a power-of-two or float32 scale is exact in float64), so what is left
is the unquantized comparison's own error.
"""

import pytest
import torch

from engine.llm import LLM
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import SamplingParams
from tests.engine.conftest import SHAPES, incremental_logits, reference_model

TOL = 1e-4


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_and_decode_logits_match_reference(checkpoints, shape):
    path = checkpoints[shape]
    ref, ours = reference_model(path, torch.float64), load_model(path, torch.float64)
    cfg = ours.cfg
    longest = max(cfg.compress_ratios)
    # a prompt plus 64+ decode steps crossing the window and several blocks of every compressor
    n_total = max(2 * longest + 8, 3 * cfg.sliding_window, 40) + 64
    ids = _prompt(cfg.vocab_size, n_total, seed=1)
    prompt_len = n_total - 64 - 7
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    scale = want.abs().max().item()
    # prefill in uneven chunks, then decode one token per step
    got = incremental_logits(ours, ids, chunks=[5, prompt_len - 5])
    err = (got - want).abs().max(dim=-1).values
    assert err[:prompt_len].max() <= TOL * scale, f"prompt logits off by {err[:prompt_len].max():.2e}"
    assert err[prompt_len:].max() <= TOL * scale, f"decode logits off by {err[prompt_len:].max():.2e}"
    assert len(ids) - prompt_len >= 64


def test_single_shot_prefill_matches_reference(tiny_dir):
    ref, ours = reference_model(tiny_dir, torch.float64), load_model(tiny_dir, torch.float64)
    ids = _prompt(ours.cfg.vocab_size, 97, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = incremental_logits(ours, ids, chunks=[len(ids)])
    assert (got - want).abs().max() <= TOL * want.abs().max()


@pytest.mark.parametrize("shape", ["tiny", "official-ratios"])
def test_greedy_generation_equals_transformers_generate(checkpoints, shape):
    path = checkpoints[shape]
    ref = reference_model(path, torch.float64)
    llm = LLM(str(path), dtype="float64")
    prompt = _prompt(llm.engine.cfg.vocab_size, 21, seed=3)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    got = llm.generate([prompt], SamplingParams(max_tokens=64, min_tokens=64, temperature=0))[0]
    assert got.token_ids == want[0, len(prompt):].tolist()


def test_bf16_close_to_reference_and_same_greedy_start(tiny_dir):
    """bf16 engine vs the fp32 reference. Stated tolerance, per position, relative to the
    logit scale: median <= 2e-2, 90th percentile <= 3e-2. Rare positions move more where
    bf16 rounding flips a discrete choice (expert routing, indexer top-k); there the bound is
    transformers' own bf16 run against the same fp32 reference."""
    ref = reference_model(tiny_dir, torch.float32)
    ref_bf16 = reference_model(tiny_dir, torch.float32).to(torch.bfloat16)
    ours = load_model(tiny_dir, torch.bfloat16)
    ids = _prompt(ours.cfg.vocab_size, 60, seed=4)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        theirs = ref_bf16(torch.tensor([ids])).logits[0].float()
    scale = want.abs().max()
    err = (incremental_logits(ours, ids, chunks=[40]) - want).abs().max(dim=-1).values / scale
    their_err = (theirs - want).abs().max(dim=-1).values / scale
    assert err.median() <= 2e-2 and err.quantile(0.9) <= 3e-2, err
    assert err.max() <= their_err.max(), (err.max(), their_err.max())
    llm = LLM(str(tiny_dir), dtype="bfloat16")
    prompt = ids[:20]
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    got_tokens = llm.generate([prompt], SamplingParams(max_tokens=16, min_tokens=16, temperature=0))[0].token_ids
    assert got_tokens == greedy[0, 20:].tolist()


@pytest.mark.parametrize("quant", ["fp8", "fp8-fp4"])
def test_quantized_checkpoint_matches_transformers_dequantized(tmp_path, quant):
    """The shipped formats (Base: FP8 experts; V4-Flash: MXFP4 experts) vs transformers reading the
    same files: prompt and decode logits, and 32 greedy tokens."""
    path = write_checkpoint(tmp_path / quant, "tiny", seed=7, quant=quant)
    ref, ours = reference_model(path, torch.float64, dequantize=True), load_model(path, torch.float64)
    ids = _prompt(ours.cfg.vocab_size, 80, seed=5)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = incremental_logits(ours, ids, chunks=[7, 40])
    assert (got - want).abs().max() <= TOL * want.abs().max(), (got - want).abs().max()
    prompt = ids[:21]
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    llm = LLM(str(path), dtype="float64")
    got_tokens = llm.generate([prompt], SamplingParams(max_tokens=32, min_tokens=32, temperature=0))[0].token_ids
    assert got_tokens == greedy[0, len(prompt):].tolist()
