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

import numpy as np
import torch

from engine.models.deepseek_v4.dspark import DSparkDrafter


class DSparkProposer:
    def __init__(self, engine, drafter: DSparkDrafter, k: int, confidence_threshold: float):
        self.engine, self.drafter, self.k, self.threshold = engine, drafter, k, confidence_threshold
        self.window = drafter.cfg.sliding_window
        # request id -> (every stage's keys [W, stages, head_dim], their positions [W] on the host)
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
        W, row, keep, where = self.window, 0, [], []
        for _, start, toks in items:  # a long prefill chunk: only its last window matters
            n = len(toks)
            lo = max(0, n - W)
            keep.append(np.arange(row + lo, row + n))
            where.append(np.arange(start + lo, start + n))
            row += n
        dev = features.device
        index = torch.from_numpy(np.concatenate(keep)).to(dev)
        kv = self.drafter.context_kv(self.engine.model, self.drafter.main_context(features[index]),
                                     torch.from_numpy(np.concatenate(where)).to(dev))
        a = 0
        for (seq, _, _), q in zip(items, where):
            if seq.request_id not in self.context:
                self.context[seq.request_id] = (kv.new_zeros(W, *kv.shape[1:]), np.full(W, -1, dtype=np.int64))
            ring, pos = self.context[seq.request_id]
            ring[torch.from_numpy(q % W).to(dev)] = kv[a:a + len(q)]
            pos[q % W] = q
            a += len(q)

    def draft(self, items, drafting) -> list[list[int]]:
        """drafting: (item index, position of its last token, drafts wanted, outputs) per sequence
        that drafts -> its drafts (none when its window of context keys is incomplete). Positions
        live on the host: deciding who drafts reads nothing back from the device."""
        W, ready, contexts, last = self.window, [], [], []
        for i, (j, base, _, _) in enumerate(drafting):
            seq, _, toks = items[j]
            ring, pos = self.context[seq.request_id]
            want = np.arange(max(0, base - W), base)
            if not np.array_equal(pos[want % W], want):
                continue
            ready.append(i)
            contexts.append((ring[torch.from_numpy(want % W).to(ring.device)], torch.from_numpy(want)))
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
