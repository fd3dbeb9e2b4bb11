"""vLLM's `prompt_logprobs`: for each prompt position after the first, the logprob of the prompt
token there, its rank over the vocabulary and the top-k, from the prefill's own forward.

Every prefill chunk contributes: the runner keeps the last residual streams (the HC head's input)
of each packed row whose next token is a prompt token not yet scored (`Sequence.prompt_logprobs_next`,
which survives preemption, so a recomputed prompt is not scored twice), and `score` runs the model's
`compute_logits` (HC head, norm, LM head) over those rows in slices of at most SLICE_BYTES of float32
logits: a long prompt never holds [prompt_len, vocab] in float32 at once. Such a step runs eagerly
(not a mixed CUDA graph, whose outputs are the sampling rows only). The conventions are the
engine's `logprobs`: raw logprobs (log_softmax of the model's logits, before any sampling
parameter), rank = how many tokens are at least as likely (vLLM's count), top-k by value; one host
copy per step.

A request asking for them skips the prefix-cache read (as vLLM does), so every position is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence

SLICE_BYTES = 256 << 20  # float32 logits held at once while scoring (~500 rows at V4's 129k vocabulary)


@dataclass
class PromptLogprobRows:
    """This step's prefill rows to score. The runner fills `hidden` ([R, hc_mult, hidden]: the rows'
    last residual streams) during the forward."""

    spans: list[tuple[Sequence, int, int]]  # (sequence, first prompt position scored, how many)
    rows: torch.Tensor  # [R] rows of the packed batch
    targets: torch.Tensor  # [R] the prompt token each row predicts
    hidden: torch.Tensor | None = None


def prompt_logprob_rows(scheduled: list[tuple[Sequence, int]], device) -> PromptLogprobRows | None:
    """The rows of a packed batch (scheduled in batch order) whose logits score a prompt token."""
    spans, rows, targets = [], [], []
    base = 0
    for seq, n in scheduled:
        if seq.sampling.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            # the row at position p predicts token p + 1: score the prompt tokens still owed
            lo, hi = max(start, seq.prompt_logprobs_next - 1), min(start + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                spans.append((seq, lo + 1, hi - lo))
                rows.extend(range(base + lo - start, base + hi - start))
                targets.extend(seq.prompt_token_ids[lo + 1:hi + 1])
        base += n
    if not spans:
        return None
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return PromptLogprobRows(spans, t(rows), t(targets))


@dataclass
class PromptScores:
    """Per scored row, on the host: the prompt token's logprob and rank, the top-k ids and values."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@torch.inference_mode()
def score(head, hidden: torch.Tensor, targets: torch.Tensor, k: int, vocab_size: int,
          slice_bytes: int | None = None) -> PromptScores:
    """`head`: hidden rows -> logits [r, vocab_size] (the model's `compute_logits`). Slices of the
    rows through the head and a float32 log_softmax on the device; one copy to the host at the end."""
    R = hidden.shape[0]
    step = max(1, (slice_bytes or SLICE_BYTES) // (4 * vocab_size))
    parts = []
    for s in range(0, R, step):
        lp = head(hidden[s:s + step]).float().log_softmax(-1)
        tok = lp.gather(1, targets[s:s + step, None])
        cols = [tok, (lp >= tok).sum(-1, keepdim=True)]
        if k > 0:
            v, i = lp.topk(min(k, vocab_size), dim=-1)
            cols += [v, i]
        parts.append(torch.cat([c.double() for c in cols], 1))
    host = torch.cat(parts).tolist()  # [R, 2 + 2k]: the step's one copy back
    kk = min(k, vocab_size) if k > 0 else 0
    return PromptScores([r[0] for r in host], [int(r[1]) for r in host],
                        [[int(t) for t in r[2 + kk:]] for r in host], [r[2:2 + kk] for r in host])
