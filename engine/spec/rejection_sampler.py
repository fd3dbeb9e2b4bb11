"""Accepting draft tokens so that the output is distributed as the target model's samples.

Rows are sequences; position j in 0..k of a row holds the target's distribution for the token
after the j-th draft (the last one: the bonus position). The drafts are proposed
deterministically (the MTP's argmax, as vLLM's MTP proposer), so q is one-hot at the draft d_j
and the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) reads:

    accept d_j with probability p_j(d_j)  (= min(1, p/q) for q one-hot);
    at the first rejection draw from norm(max(0, p_j - q_j)): p_j with d_j removed;
    when all k are accepted draw the bonus token from p_k.

Every emitted token is then distributed as p given the tokens before it. Greedy rows are the
same rule with p one-hot at the argmax, written as comparisons so it is exact.
"""

from __future__ import annotations

import torch

from engine.sampler import _TINY


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """[S, k] bool -> [S] the number of leading True."""
    return ok.int().cumprod(1).sum(1) if ok.shape[1] else ok.new_zeros(ok.shape[0], dtype=torch.long)


def _emit(draft_ids: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[S, k + 1]: the accepted drafts, then the final token at position `accepted` (the rest: -1)."""
    S, k = draft_ids.shape
    out = torch.cat([draft_ids, draft_ids.new_full((S, 1), -1)], 1)
    cols = torch.arange(k + 1, device=out.device)[None]
    out = out.masked_fill(cols > accepted[:, None], -1)
    return out.scatter(1, accepted[:, None], final[:, None])


def greedy_accept(target_argmax: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [S, k + 1], draft_ids [S, k] (padding past num_drafts [S] is ignored).
    -> (tokens [S, k + 1] with -1 past the last emitted, accepted [S])."""
    k = draft_ids.shape[1]
    live = torch.arange(k, device=draft_ids.device)[None] < num_drafts[:, None]
    accepted = _leading((target_argmax[:, :k] == draft_ids) & live)
    final = target_argmax.gather(1, accepted[:, None])[:, 0]
    return _emit(draft_ids, accepted, final), accepted


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [S, k + 1, V] (each row's processed distribution), draft_ids [S, k],
    num_drafts [S]. -> (tokens [S, k + 1] with -1 past the last emitted, accepted [S])."""
    S, k1, V = target_probs.shape
    k, dev = k1 - 1, target_probs.device
    rows = torch.arange(S, device=dev)
    live = torch.arange(k, device=dev)[None] < num_drafts[:, None]
    p_draft = target_probs[:, :k].gather(2, draft_ids[..., None])[..., 0]
    u = torch.rand(S, k, generator=generator, device=dev, dtype=p_draft.dtype)
    accepted = _leading((u < p_draft) & live)
    p = target_probs[rows, accepted].clone()  # where the final token is drawn
    rejected = accepted < num_drafts
    if k:
        d = draft_ids.gather(1, accepted.clamp(max=k - 1)[:, None])[:, 0]
        p[rows[rejected], d[rejected]] = 0  # max(0, p - onehot(d)), unnormalised
    race = torch.empty_like(p).exponential_(generator=generator)  # p / Exp(1) argmax: an exact draw from p unnormalised
    final = (p / race.clamp_(min=_TINY)).argmax(-1)
    return _emit(draft_ids, accepted, final), accepted
