"""The per-step token budget (engine/chunk_budget.py): the adaptive policy's choice for given queue states,
the step-cost fit it chooses from, and the engine's greedy output unchanged by it."""

import pytest
import torch

from engine.args import EngineArgs, InvalidEngineArgs
from engine.chunk_budget import ChunkBudget, ChunkBudgetConfig, StepCosts, budget_sizes, choose_budget
from engine.llm import LLM
from engine.request import SamplingParams

# V4-Flash-depth-like magnitudes: a decode step of 12 ms + 0.2 ms per decode (42 ms at 150), 0.08 ms per
# prefill token (12.5k tok/s); the ITL target twice the full batch's (160) decode step
DECODE_MS = lambda d: 12.0 + 0.2 * d  # noqa: E731
PER_TOKEN_MS, TARGET_MS, CAP, MIN_CHUNK = 0.08, 2 * DECODE_MS(160), 2048, 256


def _choose(decodes, prefills=3, cap=CAP, target=TARGET_MS):
    return choose_budget(decodes, prefills, DECODE_MS(decodes), PER_TOKEN_MS, target, cap, MIN_CHUNK)


def test_few_decodes_get_long_chunks_and_many_get_short_ones():
    budgets = {d: _choose(d) for d in (1, 8, 32, 64, 150)}
    chunks = [b - d for d, b in budgets.items()]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > 2 * chunks[-1], budgets
    for d, b in budgets.items():  # a captured size; the step fits the target (rounded down), or is the floor
        floor = min(s for s in budget_sizes(CAP) if s >= d + MIN_CHUNK)
        assert b in budget_sizes(CAP) and (DECODE_MS(d) + (b - d) * PER_TOKEN_MS <= TARGET_MS or b == floor)
        assert b >= floor


def test_the_cap_bounds_every_budget_and_stands_where_nothing_waits_on_the_step():
    assert _choose(0) == CAP  # no decode waits: the longest chunk
    assert _choose(40, prefills=0) == CAP  # no prompt to prefill: only the decodes run anyway
    assert _choose(8, target=1e6) == CAP  # a loose target: the cap
    assert _choose(400, cap=512) == 512  # decodes plus the floor past the cap: the cap
    assert _choose(1, cap=300) <= 300
    assert 300 in budget_sizes(300) and max(budget_sizes(300)) == 300


def test_step_costs_fit_recovers_a_linear_step_time():
    costs = StepCosts()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        d, p = torch.randint(0, 160, (1,), generator=g).item(), torch.randint(0, 2048, (1,), generator=g).item()
        costs.observe(d, p, DECODE_MS(d) + PER_TOKEN_MS * p)
    for d in (1, 64, 150):
        assert costs.decode_ms(d) == pytest.approx(DECODE_MS(d), rel=0.02)
    assert costs.ms_per_prefill_token() == pytest.approx(PER_TOKEN_MS, rel=0.02)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_adaptive_budget_learns_from_step_intervals_and_skips_idle_time():
    clock = _Clock()
    policy = ChunkBudget(ChunkBudgetConfig("adaptive", min_prefill_chunk=MIN_CHUNK), max_num_seqs=160, clock=clock)
    assert policy.budget(150, 3, CAP) == CAP  # nothing measured yet: the fixed rule
    for i in range(60):  # steps of varied makeup, each taking its modelled time
        d, p = (7 * i) % 160, (331 * i) % 2048
        policy.scheduled(d, p)
        clock.now += (DECODE_MS(d) + PER_TOKEN_MS * p) / 1e3
    policy.idle()  # the queue emptied; an hour passes before the next step
    clock.now += 3600.0
    policy.scheduled(10, 100)
    assert policy.costs.ms_per_prefill_token() == pytest.approx(PER_TOKEN_MS, rel=0.05)
    assert policy.target_ms() == pytest.approx(TARGET_MS, rel=0.05)
    assert policy.budget(150, 3, CAP) == _choose(150) and policy.budget(4, 3, CAP) == _choose(4)
    fixed = ChunkBudget(ChunkBudgetConfig("fixed"), max_num_seqs=160, clock=clock)
    assert fixed.budget(150, 3, CAP) == CAP


def test_options_are_checked():
    with pytest.raises(InvalidEngineArgs, match="chunk_budget"):
        EngineArgs.from_dict({"chunk_budget": "dynamic"})
    with pytest.raises(InvalidEngineArgs, match="itl_target_factor"):
        EngineArgs.from_dict({"itl_target_factor": 0.5})
    assert ChunkBudgetConfig.of(EngineArgs.from_dict({"chunk_budget": "adaptive", "itl_target_ms": 50})) == \
        ChunkBudgetConfig("adaptive", 50.0, 2.0, 256)


def test_greedy_output_is_the_same_with_fixed_and_adaptive_budgets(tiny_dir):
    """A tight ITL target: once the costs have seen their warm-up steps, every step with decodes takes
    only min_prefill_chunk prompt tokens (the smallest captured size holding them), where the fixed budget
    takes 128; the greedy tokens must not change."""
    g = torch.Generator().manual_seed(3)
    vocab = 1000
    prompts = [torch.randint(5, vocab, (L,), generator=g).tolist() for L in (150, 40, 200, 90, 170, 60, 120, 30)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs = {}
    for mode in ("fixed", "adaptive"):
        llm = LLM(str(tiny_dir), dtype="float64", max_model_len=256, max_num_batched_tokens=128, max_num_seqs=4,
                  chunk_budget=mode, itl_target_ms=1e-3, min_prefill_chunk=8)
        sched, steps = llm.engine.scheduler, []
        schedule = sched.schedule

        def spy(schedule=schedule, steps=steps):
            out = schedule()
            steps.append((sum(n == 1 for _, n in out), sum(n for _, n in out if n > 1)))
            return out

        sched.schedule = spy
        runs[mode] = ([o.token_ids for o in llm.generate(prompts, params)], steps)
    (fixed, fixed_steps), (adaptive, adaptive_steps) = runs["fixed"], runs["adaptive"]
    assert adaptive == fixed
    assert max(p for d, p in fixed_steps if d) > 64  # fixed: long chunks beside decodes
    late = adaptive_steps[ChunkBudget.WARMUP_STEPS + 1:]
    assert any(d and p for d, p in late) and all(d + p <= 16 for d, p in late if d and p), adaptive_steps
