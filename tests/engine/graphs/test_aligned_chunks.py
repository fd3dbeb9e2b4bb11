"""Prefill chunks cut back to a mixed-step graph's size where the padding would cost more than one more small
step (engine/graphs/aligned_chunks.py): the rule, the scheduler's steps, and the engine's tokens unchanged."""

import torch

from engine.graphs import aligned_chunks
from engine.graphs.aligned_chunks import aligned
from engine.graphs.mixed import mixed_sizes
from engine.llm import LLM
from engine.request import SamplingParams

SIZES = mixed_sizes(2048)  # ..., 768, 1024, 1536, 2048: the served budget's graphs


def test_a_prompt_one_token_past_a_size_is_cut_back_to_it():
    # 1024 text tokens and the BOS: the 1536-token graph would pad 511 rows
    assert aligned([("p", 1025)], SIZES) == [("p", 1024)]
    # decodes keep their token; the prefill chunk gives the 76 tokens past 1024
    assert aligned([("d1", 1), ("d2", 1), ("p", 1098)], SIZES) == [("d1", 1), ("d2", 1), ("p", 1022)]
    # the newest chunk gives them (the older prompt keeps its progress) ...
    assert aligned([("a", 600), ("b", 425)], SIZES) == [("a", 600), ("b", 424)]
    # ... or, too short to give them and keep a token, the one before it
    assert aligned([("a", 1080), ("b", 20)], [512, 1024, 2048]) == [("a", 1004), ("b", 20)]


def test_steps_kept_whole():
    for scheduled in ([("p", 1024)],  # a size already
                      [("p", 1400)],  # 136 rows of padding against 376 tokens moved and a step: not worth it
                      [("p", 20)],  # 12 rows of padding: a step costs more
                      [("p", 3000)],  # past the largest graph: eager, nothing padded
                      [("p", 9)],  # below the smallest size: nothing to cut back to
                      [("d", 1)] * 1025):  # decodes only: nothing can give a token
        assert aligned(scheduled, SIZES) == scheduled
    assert aligned([("p", 1025)], []) == [("p", 1025)]  # no mixed graphs (eager steps, the CPU)
    # 286 rows of padding against 226 tokens moved: kept at the default step's cost, cut were a step free
    assert aligned([("p", 1250)], SIZES) == [("p", 1250)]
    assert aligned([("p", 1250)], SIZES, step_tokens=0) == [("p", 1024)]


def _engine(tiny_dir, **kw):
    return LLM(str(tiny_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64, **kw)


def test_engine_steps_follow_the_sizes_and_tokens_do_not_change(tiny_dir, monkeypatch):
    """A 33-token prompt against graphs of 16 / 32 / 64 tokens: cut to 32 + 1 where a step is free (STEP_TOKENS 0),
    whole at the default cost; greedy tokens and logprobs as the uncut run's (a chunk boundary, not new math)."""
    g = torch.Generator().manual_seed(3)
    plain = _engine(tiny_dir)
    prompts = [torch.randint(5, plain.engine.cfg.vocab_size, (33,), generator=g).tolist()]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    want = plain.generate(prompts, params)

    cut = _engine(tiny_dir)
    cut.engine.scheduler.graph_sizes = [16, 32, 64]
    seen = []
    schedule = cut.engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.append([n for _, n in out])
        return out

    cut.engine.scheduler.schedule = recording
    monkeypatch.setattr(aligned_chunks, "STEP_TOKENS", 0)
    got = cut.generate(prompts, params)
    assert seen[:2] == [[32], [1]]  # the 33-token prompt in two steps, the first on a size
    assert got[0].token_ids == want[0].token_ids
    sampled = [[lp[t] for lp, t in zip(out.logprobs, out.token_ids)] for out in (got[0], want[0])]
    assert torch.allclose(torch.tensor(sampled[0]), torch.tensor(sampled[1]), atol=1e-4)
    monkeypatch.setattr(aligned_chunks, "STEP_TOKENS", 128)
    seen.clear()
    assert cut.generate(prompts, params)[0].token_ids == want[0].token_ids
    assert seen[0] == [33]  # 31 rows of padding: less than a step
