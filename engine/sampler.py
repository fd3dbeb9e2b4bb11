"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

A seeded request draws token i from a generator seeded by (seed, i), so its tokens do not
depend on batch mates, step boundaries or preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as K
from engine.request import SamplingParams


@dataclass
class Sample:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one row of fp32 logits."""
    logits = logits / p.temperature
    if p.top_k and p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _generator(seed: int | None, step: int, fallback: torch.Generator) -> torch.Generator:
    if seed is None:
        return fallback
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + step) % (2**63 - 1))


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           extra_masks: list[list[int]] | None = None, fallback: torch.Generator | None = None) -> list[Sample]:
    """logits [n, V] fp32; steps[i] = how many tokens request i has already generated;
    extra_masks[i] = token ids forbidden for this step (EOS before min_tokens)."""
    fallback = fallback or torch.Generator().manual_seed(0)
    logits = logits.float()
    if extra_masks and any(extra_masks):
        logits = logits.clone()
        for i, mask in enumerate(extra_masks):
            if mask:
                logits[i, mask] = float("-inf")
    # greedy rows need only their argmax: pick on the device (argmax, its logprob and the
    # log-sum-exp in one pass) and copy back three numbers per row, never the logits
    picked = K.greedy_pick(logits)
    want_lp = [p.logprobs is not None for p in params]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    rows = dict(zip(sampled, logits[sampled].cpu())) if sampled else {}  # one copy for all of them
    tokens, chosen, lse = picked.tolist()  # the step's one host sync
    tokens = [int(t) for t in tokens]
    for i, row in rows.items():
        p = params[i]
        probs = _filter(row, p).softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=_generator(p.seed, steps[i], fallback)))
        chosen[i] = float(row[tokens[i]]) - lse[i]
    logprobs_dev = logits - picked[2, :, None].float() if any(want_lp) else None
    out = []
    for i, p in enumerate(params):
        top = None
        if want_lp[i]:
            n = min(int(p.logprobs), logprobs_dev.shape[-1])
            values, ids = torch.topk(logprobs_dev[i], n) if n > 0 else (torch.empty(0), torch.empty(0))
            top = {int(t): float(v) for t, v in zip(ids.tolist(), values.tolist())}
            top[tokens[i]] = chosen[i]
        out.append(Sample(tokens[i], chosen[i], top))
    return out
