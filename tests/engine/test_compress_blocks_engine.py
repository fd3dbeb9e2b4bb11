"""The compressors' multi-row step through its fused kernel (kernels/fused_compress_blocks.py, under
the Triton interpreter) vs the torch reference, end to end in the engine: a prompt prefilled in
chunks that start mid-block, then a second prompt sharing its prefix (a prefix-cache hit: the
compressors resume from the boundary state, replay the window, then prefill the rest in chunks),
with mixed prefill + decode steps in between. Every other op stays on its reference, so only the
compressor path differs.

float32: the kernel computes in float32 inside, so the two agree to float32 rounding; the tokens
must be equal and every sampled token's logprob within 1e-4 (absolute) of the reference's."""

import torch

import kernels
from engine.llm import LLM
from engine.request import SamplingParams
from kernels.fused_compress_blocks import compress_blocks_fused

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


def _run(tiny_dir, fused: bool, monkeypatch):
    llm = LLM(str(tiny_dir), dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=27)
    kernels.set_backend("ref")  # after the engine, which sets its `kernels` argument's backend
    if fused:
        monkeypatch.setattr(kernels, "compress_blocks", compress_blocks_fused)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(5, llm.engine.cfg.vocab_size, (70,), generator=g).tolist()
    b = a[:64] + torch.randint(5, llm.engine.cfg.vocab_size, (23,), generator=g).tolist()
    c = torch.randint(5, llm.engine.cfg.vocab_size, (9,), generator=g).tolist()
    outs = llm.generate([a, c], SP) + llm.generate([b], SP)
    return outs, llm.engine.stats()


def test_prefill_chunks_and_a_prefix_hit_through_the_fused_compressor(tiny_dir, monkeypatch):
    try:
        want, want_stats = _run(tiny_dir, False, monkeypatch)
        got, got_stats = _run(tiny_dir, True, monkeypatch)
    finally:
        monkeypatch.undo()
        kernels.set_backend("auto")
    assert got_stats["prefix_cache_hits"] == want_stats["prefix_cache_hits"] == 1
    for w, o in zip(want, got, strict=True):
        assert o.token_ids == w.token_ids
        lw = torch.tensor([d[t] for d, t in zip(w.logprobs, w.token_ids)])
        lo = torch.tensor([d[t] for d, t in zip(o.logprobs, o.token_ids)])
        assert (lw - lo).abs().max() <= 1e-4, (lw, lo)
