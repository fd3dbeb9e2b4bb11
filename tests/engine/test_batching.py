"""Continuous batching over the paged hybrid cache: same outputs as alone, bounded window
blocks, preemption by recompute, aborts that return every block."""

import torch

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams


def _prompts(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (L,), generator=g).tolist() for L in lengths]


def _full(engine: LLMEngine) -> bool:
    c = engine.cache
    return (c.window_pool.num_free == c.window_pool.num_blocks and c.full_pool.num_free == c.full_pool.num_blocks
            and len(c.free_slots) == c.max_num_seqs)


def test_concurrent_greedy_equals_alone_with_chunking_and_preemption(tiny_dir):
    alone = LLM(str(tiny_dir), dtype="float64", max_model_len=256)
    prompts = _prompts(26, alone.engine.cfg.vocab_size)
    params = [SamplingParams(max_tokens=5 + 3 * (i % 9), temperature=0, ignore_eos=True) for i in range(26)]
    want = [alone.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]
    # small token budget: long prompts are split into chunks mixed with decodes;
    # 30 compressed blocks of 16 tokens cannot hold 26 sequences: preemption must happen
    batched = LLM(str(tiny_dir), dtype="float64", max_model_len=256, max_num_batched_tokens=48,
                  max_num_seqs=32, num_gpu_blocks_override=30)
    got = batched.generate(prompts, params)
    assert batched.engine.scheduler.num_preemptions > 0
    assert [g.token_ids for g in got] == want
    assert all(g.finish_reason == "length" for g in got)
    assert _full(batched.engine)


def test_window_blocks_stay_bounded_however_long_the_sequence(tiny_dir):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 1024})
    W, bs = eng.cfg.sliding_window, eng.block_size
    eng.add_request(GenerationRequest("long", prompt_token_ids=[7] * 50,
                                      sampling=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)))
    worst_window, steps = 0, 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        seq = eng.scheduler.running[0] if eng.scheduler.running else None
        if seq is not None:
            held = sum(b >= 0 for b in seq.blocks.window_table)
            worst_window = max(worst_window, held)
            # compressed blocks grow with the sequence; window blocks do not
            assert len(seq.blocks.full_table) == -(-seq.num_computed_tokens // bs)
    assert steps > 300
    assert worst_window <= -(-(W - 1 + 50) // bs) + 1  # the prefill chunk plus the window, never more
    assert _full(eng)


def test_abort_in_prefill_and_in_decode_returns_every_block(tiny_dir):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_num_batched_tokens": 16})
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    eng.add_request(GenerationRequest("decoding", prompt_token_ids=[9] * 5, sampling=sp))
    eng.add_request(GenerationRequest("prefilling", prompt_token_ids=list(range(10, 110)), sampling=sp))
    for _ in range(3):
        eng.step()
    pre, dec = (next(s for s in eng.scheduler.running if s.request_id == r) for r in ("prefilling", "decoding"))
    assert 0 < pre.num_computed_tokens < pre.num_prompt_tokens and len(dec.output_token_ids) > 0
    out = eng.abort("prefilling")
    assert out.finished and out.finish_reason == "abort"
    eng.step()
    assert eng.abort("decoding").finish_reason == "abort"
    assert not eng.has_unfinished() and _full(eng)
    eng.add_request(GenerationRequest("waiting", prompt_token_ids=[3] * 4, sampling=sp))
    assert eng.abort("waiting").finish_reason == "abort" and _full(eng)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float64")
    sp = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
          for i in range(6)]
    prompts = _prompts(6, llm.engine.cfg.vocab_size, seed=5)
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, sp)]
    together = [c.token_ids for c in llm.generate(prompts, sp)]
    assert together == alone
    other_seed = llm.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0.9, seed=1, ignore_eos=True))
    assert other_seed[0].token_ids != alone[0]
