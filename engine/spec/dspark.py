"""The DSpark proposer (docs/DSPARK.md): what the speculative decoder keeps per sequence for the
0731 drafter, and the drafts of a step.

Per sequence it keeps every stage's keys for its last `sliding_window` positions
(DSparkDrafter.context_kv of the main context of the target's features: they depend only on those
features and the position, so each is computed once, when its features arrive) in one
preallocated key ring on the device, [state slots x window] rows: slot s holds position p at row
s * window + p % window, so a CUDA graph addresses any sequence's window by its slot alone
(engine/spec/dspark_graphs.py). A position run again (after a rejection, a preemption, a
prefix-cache hit's bounded replay) is simply rewritten. Which position each row holds, and which
sequence owns a slot, live on the host: a block is drafted only when every position of its window
is there, decided without reading anything back. Each drafting sequence then gets one block from
the drafter; the confidence head's verify length (and k) caps what is verified: possibly nothing
(gated_lengths), and then the sequence's next step is a plain one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.models.deepseek_v4.dspark import Drafts, DSparkDrafter


def gated_lengths(d: Drafts, threshold: float) -> torch.Tensor:
    """The verify lengths served: the confidence head's (DSparkDrafter: the longest prefix whose
    predicted probability of being accepted whole, prod sigmoid(confidence_i), stays >= threshold,
    at least one draft), but none where even the first draft is predicted below the threshold: a
    block that is expected to fail whole is not worth a verify step (docs/DSPARK.md). On the device
    (a graph leaves it beside the drafts)."""
    first = torch.sigmoid(d.confidence[:, 0].double()) >= threshold
    return torch.where(first, d.verify_len, torch.zeros_like(d.verify_len))


@dataclass(frozen=True)
class NewRows:
    """An item's rows whose keys go into the ring (a prefill chunk's last window, else all of them)."""
    first: int  # the first such row, counted from the item's first row
    positions: np.ndarray  # their positions
    ring_rows: np.ndarray  # their rows in the ring


@dataclass(frozen=True)
class Ready:
    """A drafting sequence whose window of keys is complete."""
    index: int  # into the step's `drafting` list
    slot: int  # its state slot: its window's rows in the ring
    start: int  # the block's first position (its last token's)
    last_token: int


class DSparkProposer:
    def __init__(self, engine, drafter: DSparkDrafter, k: int, confidence_threshold: float):
        self.engine, self.drafter, self.k, self.threshold = engine, drafter, k, confidence_threshold
        cfg, cache = drafter.cfg, engine.cache
        self.window = W = cfg.sliding_window
        self.scratch = cache.scratch_slot  # padding rows (graphs) write and read here
        slots = cache.scratch_slot + 1  # every sequence's state slot, then the scratch slot
        self.ring = torch.zeros(slots * W, cfg.dspark.num_stages, cfg.head_dim, dtype=engine.model.embed.weight.dtype,
                                device=engine.device)
        self.positions = np.full((slots, W), -1, dtype=np.int64)  # the position each ring row holds (-1: none)
        self.owner: dict[int, object] = {}  # slot -> the Sequence whose keys it holds
        self.chosen_lengths: Counter[int] = Counter()  # the verify lengths chosen (before k; 0: none)

    def new_rows(self, items) -> list[NewRows]:
        """items: (sequence, first position, tokens) per sequence whose rows of this step are known
        (engine/spec/decoder.py's _catch_up) -> the rows of each whose keys go into the ring, which
        the host now records as held. A slot another sequence held starts empty."""
        W, out = self.window, []
        for seq, start, toks in items:
            slot, n = seq.blocks.state_slot, len(toks)
            if self.owner.get(slot) is not seq:
                self.owner[slot] = seq
                self.positions[slot] = -1
            lo = max(0, n - W)  # a long prefill chunk: only its last window matters
            q = np.arange(start + lo, start + n)
            self.positions[slot, q % W] = q
            out.append(NewRows(lo, q, slot * W + q % W))
        return out

    def absorb(self, items, features: torch.Tensor | None) -> None:
        """Eagerly: the keys of the items' rows into the ring; features: those rows' target features, in order."""
        if features is None:
            return
        rows, row = self.new_rows(items), 0
        index = []
        for (_, _, toks), r in zip(items, rows):
            index.append(np.arange(row + r.first, row + len(toks)))
            row += len(toks)
        dev, cat = features.device, np.concatenate
        self.drafter.write_context(self.engine.model, self.ring, features[torch.from_numpy(cat(index)).to(dev)],
                                   torch.from_numpy(cat([r.positions for r in rows])).to(dev),
                                   torch.from_numpy(cat([r.ring_rows for r in rows])).to(dev))

    def ready(self, items, drafting) -> list[Ready]:
        """drafting: (item index, position of its last token, drafts wanted, outputs) per sequence
        that drafts -> those whose window of keys is complete (on the host: reads nothing back)."""
        W, out = self.window, []
        for i, (j, base, _, _) in enumerate(drafting):
            seq, _, toks = items[j]
            slot = seq.blocks.state_slot
            want = np.arange(max(0, base - W), base)
            if self.owner.get(slot) is seq and np.array_equal(self.positions[slot, want % W], want):
                out.append(Ready(i, slot, base, toks[-1]))
        return out

    def draft(self, items, drafting) -> list[list[int]]:
        """Eagerly: each drafting sequence's drafts (none when its window is incomplete)."""
        ready = self.ready(items, drafting)
        if not ready:
            return [[] for _ in drafting]
        t = lambda x: torch.tensor(x, device=self.ring.device)
        d = self.drafter.draft_from_ring(self.engine.model, self.ring, t([r.slot for r in ready]),
                                         t([r.start for r in ready]), t([r.last_token for r in ready]), self.threshold)
        return self.take(drafting, ready, d.tokens.tolist(), gated_lengths(d, self.threshold).tolist())

    def take(self, drafting, ready: list[Ready], tokens: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """The drafts each drafting sequence verifies: its block cut to the confidence head's length and k."""
        out = [[] for _ in drafting]
        for r, toks, n in zip(ready, tokens, lengths):
            self.chosen_lengths[n] += 1
            out[r.index] = toks[:min(n, drafting[r.index][2])]
        return out
