"""DeepSeek-V4.1's part of a padded mixed step (engine/graphs/mixed.py): the per-step values its
forward would otherwise take from the host, as fixed-capacity fields of the static batch.

- the Engram look-back: the k token ids before each row ([T, k], DEAD for padding rows), as the
  decode graphs' static batch carries it (engine/runner.py);
- decoder trim: the layers after the last KV source run on each sequence's last
  `sliding_window` rows. Their count varies per step and no fixed capacity below T holds every
  step's at a serving max_num_seqs, so the step runs as two graphs, the second captured per count
  of kept rows (engine/models/deepseek_v41/split_graphs.py; its batches carry these fields too).

The indexer's scores and the compressors' plans need nothing more: the first are sized from the
batch's fixed `max_pos` (kernels.v41_index_scores), the second are V4's padded plans.
"""

from __future__ import annotations

import numpy as np

from engine.forward_batch import DEAD, lookback_rows

PLAN_KEY = "v41_mixed"  # in fb.plans: a padded mixed step (the forward does not trim it: its tail graph does)


class V41MixedRows:
    """The fields, their padding and their packing, for MixedStepGraphs (one per model and cache)."""

    def __init__(self, model, cache, lookback: bool = True):
        """lookback False: no look-back field (a split's tail without Engram layers)."""
        self.model, self.cache = model, cache
        self.k = model.lookback_tokens if lookback else 0

    def fields(self, T: int, S: int) -> list[tuple[str, int]]:
        return [("lookback_ids", T * self.k)] if self.k else []

    def pad(self, col, S: int) -> None:
        """The all-padding values (col(name): that field of the flat host buffer)."""
        if self.k:
            col("lookback_ids")[:] = DEAD

    def pack(self, col, scheduled, starts: np.ndarray, row0: np.ndarray) -> None:
        """The real rows' values over the padding (already in place): scheduled (sequence, rows) from
        `starts`, packed from `row0`."""
        if self.k:
            lb = col("lookback_ids").reshape(-1, self.k)
            for (seq, m), start, r in zip(scheduled, starts, row0):
                lb[r:r + m] = lookback_rows(seq.token_ids, int(start), m, self.k).numpy()

    def attach(self, fb, view, T: int) -> None:
        """Point the static batch at its fields (view(name): that field of the device buffer)."""
        if self.k:
            fb.lookback_ids = view("lookback_ids").view(T, self.k)
        fb.plans[PLAN_KEY] = None  # the key marks the padded step
