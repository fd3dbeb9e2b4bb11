"""Each step's token budget: fixed (`max_num_batched_tokens`) or chosen from the queue (adaptive).

Adaptive, in the spirit of vLLM's and SGLang's chunked prefill: long prefill chunks while few decodes
run, short ones while many do. A step's time is every running stream's inter-token latency, so the
decodes get an ITL target (`itl_target_ms`, or `itl_target_factor` times the decode step of a full batch,
`max_num_seqs`) and the prefill chunk is what the target leaves after the running decodes' own step, at
the measured cost of a prefill token: few decodes leave much of it, many leave little. The time a step
takes is learned online (StepCosts: c0 + per decode + per prefill token). Budgets are captured mixed-step
sizes (engine/graphs/mixed.py), so a full step replays a graph with no padding; `max_num_batched_tokens`
stays the hard cap and `min_prefill_chunk` the floor of prompt tokens per step. Until the costs have seen
a few steps the budget is the cap (the fixed rule).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from engine.args import EngineArgs
from engine.graphs.mixed import mixed_sizes


@dataclass(frozen=True)
class ChunkBudgetConfig:
    """The engine arguments of the policy (engine/args.py)."""

    mode: str = "fixed"
    itl_target_ms: float = 0.0  # 0: itl_target_factor x the decode step of a full batch (max_num_seqs)
    itl_target_factor: float = 2.0  # suite mixed_budget's question: ITL within 2x of the decode step
    min_prefill_chunk: int = 256  # prompt tokens per step however many decodes run: prompts never starve

    @classmethod
    def of(cls, args: EngineArgs) -> ChunkBudgetConfig:
        return cls(args.chunk_budget, args.itl_target_ms, args.itl_target_factor, args.min_prefill_chunk)


@functools.lru_cache(maxsize=8)
def budget_sizes(cap: int) -> tuple[int, ...]:
    """The budgets the policy picks from: the mixed-step graphs' token counts up to the cap."""
    return tuple(mixed_sizes(cap))


def choose_budget(decodes: int, prefills: int, decode_ms: float, ms_per_prefill_token: float, target_ms: float,
                  cap: int, min_chunk: int) -> int:
    """The token budget for a step with `decodes` running decodes and `prefills` prompts to (continue to)
    prefill: the cap when either is none; else the decodes plus the prefill tokens that fit the target
    step time after the decode step, at least `min_chunk` of them, rounded down to a captured size (but
    not below the smallest that holds the decodes and `min_chunk`), never above the cap."""
    if decodes == 0 or prefills == 0:
        return cap
    room = max(target_ms - decode_ms, 0.0)
    chunk = room / ms_per_prefill_token if ms_per_prefill_token > 0 else float(cap)
    want = decodes + max(chunk, min_chunk)
    sizes = budget_sizes(cap)
    below = [s for s in sizes if s <= want]
    holds = [s for s in sizes if s >= decodes + min_chunk]
    return min(max(below[-1] if below else sizes[0], holds[0] if holds else cap), cap)


# features: [1, decodes / 100, prefill tokens / 1000]; coefficients in ms (a step's fixed part, per 100
# decodes, per 1000 prefill tokens). The prior only steers what the steps cannot decide yet (a hundredth of
# a step's weight): H200 V4-Flash-depth magnitudes (suite decode_depth's batch-150 step; prefill ~8k tok/s).
_SCALE = np.array([1.0, 1e-2, 1e-3])
_PRIOR = np.array([10.0, 20.0, 125.0])


class StepCosts:
    """A step's time as c0 + c_d * decodes + c_p * prefill tokens: least squares over the steps seen, each
    step's weight decaying by `forget` per step (recent steps count most), with a small ridge towards
    _PRIOR so that a direction the steps have not varied in stays defined."""

    def __init__(self, forget: float = 0.98, ridge: float = 1e-2):
        self.forget, self.ridge = forget, ridge
        self.gram = np.zeros((3, 3))
        self.rhs = np.zeros(3)
        self.coef = _PRIOR.copy()
        self.samples = 0

    def observe(self, decodes: int, prefill_tokens: int, ms: float) -> None:
        x = np.array([1.0, decodes, prefill_tokens]) * _SCALE
        self.gram = self.forget * self.gram + np.outer(x, x)
        self.rhs = self.forget * self.rhs + ms * x
        self.coef = np.linalg.solve(self.gram + self.ridge * np.eye(3), self.rhs + self.ridge * _PRIOR)
        self.samples += 1

    def decode_ms(self, decodes: int) -> float:
        c0, cd, _ = self.coef * _SCALE
        return max(c0 + cd * decodes, 1e-3)

    def ms_per_prefill_token(self) -> float:
        return max(float(self.coef[2] * _SCALE[2]), 1e-6)


class ChunkBudget:
    """The scheduler's budget per step. `budget` is asked once per step, before the step is scheduled; the
    time from one step's scheduling to the next is that step's time (with async scheduling it is the
    step before's, which the fit's window of similar steps absorbs)."""

    WARMUP_STEPS = 8  # steps the costs see before the budget adapts

    def __init__(self, config: ChunkBudgetConfig, max_num_seqs: int, clock=time.perf_counter):
        self.config, self.max_num_seqs, self.clock = config, max_num_seqs, clock
        self.costs = StepCosts()
        self._last: tuple[float, int, int] | None = None  # (scheduled at, decodes, prefill tokens)

    @property
    def adaptive(self) -> bool:
        return self.config.mode == "adaptive"

    def budget(self, decodes: int, prefills: int, cap: int) -> int:
        c = self.config
        if not self.adaptive or self.costs.samples < self.WARMUP_STEPS:
            return cap
        return choose_budget(decodes, prefills, self.costs.decode_ms(decodes), self.costs.ms_per_prefill_token(),
                             self.target_ms(), cap, c.min_prefill_chunk)

    def target_ms(self) -> float:
        c = self.config
        return c.itl_target_ms or c.itl_target_factor * self.costs.decode_ms(self.max_num_seqs)

    def scheduled(self, decodes: int, prefill_tokens: int) -> None:
        """This step's makeup, once scheduled: closes the last step's interval and opens this one's. An
        empty step (idle, or only tokens in flight) opens none, so idle time is never a step's."""
        if not self.adaptive:
            return
        now = self.clock()
        if self._last is not None:
            at, d, p = self._last
            self.costs.observe(d, p, (now - at) * 1e3)
        self._last = (now, decodes, prefill_tokens) if decodes or prefill_tokens else None

    def idle(self) -> None:
        """The queue emptied: the time until the next step is no step's."""
        self._last = None
