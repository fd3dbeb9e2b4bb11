"""The DSpark proposer (docs/DSPARK.md): what the speculative decoder keeps per sequence for the
0731 drafter, and the drafts of a step.

Per sequence it keeps every stage's keys for its last `sliding_window` positions
(DSparkDrafter.context_kv of the main context of the target's features: they depend only on those
features and the position, so each is computed once, when its features arrive), in a ring
indexed by position: a position run again (after a rejection, a preemption, a prefix-cache hit's
bounded replay) is simply rewritten, and a block is drafted only when every position of its
window is there. Each drafting sequence then gets one
block from the drafter; the confidence head's verify length (and k) caps what is verified.
"""

from __future__ import annotations

from collections import Counter

import torch

from engine.models.deepseek_v4.dspark import DSparkDrafter


class DSparkProposer:
    def __init__(self, engine, drafter: DSparkDrafter, k: int, confidence_threshold: float):
        self.engine, self.drafter, self.k, self.threshold = engine, drafter, k, confidence_threshold
        self.window = drafter.cfg.sliding_window
        # request id -> (every stage's keys [W, stages, head_dim], their positions [W])
        self.context: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.chosen_lengths: Counter[int] = Counter()  # the confidence head's verify lengths (before k)

    def absorb(self, items, features: torch.Tensor | None) -> None:
        """items: (sequence, first position, tokens) per sequence whose rows of this step are known
        (engine/spec/decoder.py's _catch_up), features: those rows' target features, in order."""
        live = self.engine.requests
        for rid in [r for r in self.context if r not in live]:
            del self.context[rid]
        if features is None:
            return
        W, row, kept, keep, where = self.window, 0, 0, [], []
        spans = []  # per item: its kept rows' range in keep / where
        for seq, start, toks in items:  # a long prefill chunk: only its last window matters
            n = len(toks)
            lo = max(0, n - W)
            keep.append(torch.arange(row + lo, row + n))
            where.append(torch.arange(start + lo, start + n))
            spans.append((seq, kept, kept + n - lo))
            row, kept = row + n, kept + n - lo
        dev = features.device
        keep, where = torch.cat(keep).to(dev), torch.cat(where).to(dev)
        kv = self.drafter.context_kv(self.engine.model, self.drafter.main_context(features[keep]), where)
        for seq, a, b in spans:
            if seq.request_id not in self.context:
                self.context[seq.request_id] = (kv.new_zeros(W, *kv.shape[1:]),
                                                torch.full((W,), -1, dtype=torch.long, device=dev))
            ring, pos = self.context[seq.request_id]
            q = where[a:b]
            ring[q % W], pos[q % W] = kv[a:b], q

    def draft(self, items, drafting) -> list[list[int]]:
        """drafting: (item index, position of its last token, drafts wanted, outputs) per sequence
        that drafts -> its drafts (none when its window of main context is incomplete)."""
        W, ready, contexts, last = self.window, [], [], []
        for i, (j, base, _, _) in enumerate(drafting):
            seq, _, toks = items[j]
            ring, pos = self.context[seq.request_id]
            want = torch.arange(max(0, base - W), base, device=pos.device)
            if not torch.equal(pos[want % W], want):
                continue
            ready.append(i)
            contexts.append((ring[want % W], want))
            last.append(toks[-1])
        out = [[] for _ in drafting]
        if not ready:
            return out
        d = self.drafter.draft(self.engine.model, contexts, last, self.threshold)
        tokens = d.tokens.tolist()
        for i, toks, n in zip(ready, tokens, d.verify_len):
            self.chosen_lengths[n] += 1
            out[i] = toks[:min(n, drafting[i][2])]
        return out
