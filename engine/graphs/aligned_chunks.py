"""Prefill chunks cut to the mixed-step graphs' token counts where padding would cost more than a step.

A mixed step of T tokens replays the graph of the smallest captured size >= T (engine/graphs/mixed.py), and
every padding token runs through every layer as a real one: its GEMMs, its experts. A prompt one token past a
size pays for the next size whole: 1025 tokens (a 1024-token text and its BOS) replay the 1536-token graph,
~1.5x the 1024-token step (V4-Flash depth on the H100: 102 ms engine-direct for 1024 prompt tokens, 156 ms
through Triton for the same text with its BOS, which this padding would explain). Cutting the step's newest
prefill chunk back to the size below moves those tokens to the next step instead, which costs one more small
step; so a step is cut only where the padding it saves is more than the tokens it moves plus STEP_TOKENS, a
small step's time in prefill tokens.
"""

from __future__ import annotations

# one more mixed step of a few tokens, in prefill tokens' time: a small graph step is about one decode step
# (~11-12 ms at V4-Flash depth) and prefill runs at ~10 tokens a millisecond there (1024 tokens in ~102 ms)
STEP_TOKENS = 128


def aligned(scheduled: list, sizes: list[int], step_tokens: int | None = None) -> list:
    """`scheduled` ([(sequence, tokens)], the scheduler's order) with its newest prefill chunk cut by the
    tokens past the largest captured size below the step's, where the padding that saves is worth it; the same list
    otherwise (no graphs, a step past the largest, one that fits a size, too few tokens saved, or no chunk
    that can give them and keep one)."""
    step_tokens = STEP_TOKENS if step_tokens is None else step_tokens
    total = sum(n for _, n in scheduled)
    if not sizes or total > sizes[-1]:
        return scheduled
    padded = next(s for s in sizes if s >= total)
    below = max((s for s in sizes if s < total), default=0)
    cut = total - below
    if padded == total or below == 0 or padded - total <= cut + step_tokens:
        return scheduled
    for i in range(len(scheduled) - 1, -1, -1):  # the newest chunk first: the older ones keep their progress
        seq, n = scheduled[i]
        if n > cut:  # a decode (one token) never gives any
            return [*scheduled[:i], (seq, n - cut), *scheduled[i + 1:]]
    return scheduled
