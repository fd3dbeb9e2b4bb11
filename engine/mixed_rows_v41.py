"""DeepSeek-V4.1's part of a padded mixed step (engine/mixed_graphs.py): the per-step values its
forward would otherwise take from the host, as fixed-capacity fields of the static batch.

- the Engram look-back: the k token ids before each row ([T, k], DEAD for padding rows), as the
  decode graphs' static batch carries it (engine/runner.py);
- decoder-side bounded replay's row selection: the layers after the last KV source run on each
  sequence's last `sliding_window` rows. Their count varies per step, so they are padded to a
  capacity that holds any step of the size: min(T, L * sliding_window) for L sampling rows at
  most. The kept rows' metadata is packed here too, so a padding row (position 0 of the padding
  sequence) reads and writes only the scratch block, whatever row it takes its state from.
  A step whose sequences drop nothing keeps every row (the same result as not trimming).

The indexer's scores and the compressors' plans need nothing more: the first are sized from the
batch's fixed `max_pos` (kernels.v41_index_scores), the second are V4's padded plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.engram import DEAD, lookback_rows

PLAN_KEY = "v41_mixed"  # fb.plans[PLAN_KEY]: a padded mixed step's DecoderRows (the V4.1 forward reads it)


@dataclass
class DecoderRows:
    """The rows the layers after the last KV source run on, padded to `keep.shape[0]`."""

    keep: torch.Tensor  # [K] row of the full batch each kept row takes its state from (padding: 0)
    positions: torch.Tensor  # [K] (padding: 0)
    token_seq: torch.Tensor  # [K] (padding: the padding sequence)
    window_slots: torch.Tensor  # [K] (padding: the scratch block)
    replay_start_t: torch.Tensor  # [S] a sequence that drops rows reads no position below its first kept one
    logits_rows: torch.Tensor  # [L] into the kept rows


_KEEP = ("keep", "keep_positions", "keep_token_seq", "keep_window_slots")


class V41MixedRows:
    """The fields, their padding and their packing, for MixedSteps (one per model and cache)."""

    def __init__(self, model, cache):
        cfg = model.cfg
        self.model = model  # its decoder_replay switch is read per step
        self.k = model.engram_lookback
        self.window = cfg.sliding_window
        self.trims = cfg.last_kv_source + 1 < cfg.num_layers  # some layers own only window KV
        self.cache = cache

    def capacity(self, T: int, L: int) -> int:
        return min(T, L * self.window)

    def prefers_eager(self, scheduled, size: int, L: int) -> bool:
        """Decoder replay keeps each sequence's last `window` rows on the trimmed layers: eagerly those
        layers run just the kept rows, a graph of `size` tokens runs its capacity (min(size, L * window):
        every row at the usual max_num_seqs). Where the capacity is at least twice the kept rows (a long
        prefill chunk), the eager step is the faster one (the H200's TTFT, docs/PERF.md session 7)."""
        if not (self.trims and self.model.decoder_replay):
            return False
        kept = sum(min(n, self.window) for _, n in scheduled)
        return self.capacity(size, L) >= 2 * kept

    def fields(self, T: int, S: int) -> list[tuple[str, int]]:
        out = [("lookback_ids", T * self.k)] if self.k else []
        if self.trims:
            K = self.capacity(T, S - 1)
            out += [(name, K) for name in _KEEP] + [("keep_replay_start_t", S), ("keep_logits_rows", S - 1)]
        return out

    def pad(self, col, S: int) -> None:
        """The all-padding values (col(name): that field of the flat host buffer)."""
        if self.k:
            col("lookback_ids")[:] = DEAD
        if self.trims:
            col("keep_token_seq")[:] = S - 1
            col("keep_window_slots")[:] = self.cache.scratch_window * self.cache.block_size

    def pack(self, col, scheduled, n: np.ndarray, starts: np.ndarray, row0: np.ndarray, samples: np.ndarray) -> None:
        """The real rows' values over the padding (already in place)."""
        if self.k:
            lb = col("lookback_ids").reshape(-1, self.k)
            for (seq, m), start, r in zip(scheduled, starts, row0):
                lb[r:r + m] = lookback_rows(seq.token_ids, int(start), m, self.k).numpy()
        if not self.trims:
            return
        W, S = self.window, len(scheduled)
        kept = np.minimum(n, W)
        seq = np.repeat(np.arange(S), kept)
        within = np.arange(len(seq)) - np.repeat(np.cumsum(kept) - kept, kept)
        rows = row0[seq] + n[seq] - kept[seq] + within
        K = len(rows)
        col("keep")[:K] = rows
        col("keep_positions")[:K] = starts[seq] + rows - row0[seq]
        col("keep_token_seq")[:K] = seq
        col("keep_window_slots")[:K] = col("window_slots")[rows]
        replay = np.fromiter((s.replay_start for s, _ in scheduled), dtype=np.int64, count=S)
        col("keep_replay_start_t")[:S] = np.where(n > W, np.maximum(replay, starts + n - W), replay)
        last = (np.cumsum(kept) - 1)[samples]
        col("keep_logits_rows")[:len(last)] = last

    def attach(self, fb, view, T: int) -> None:
        """Point the static batch at its fields (view(name): that field of the device buffer)."""
        if self.k:
            fb.lookback_ids = view("lookback_ids").view(T, self.k)
        # the key marks the padded step (the indexer's fixed-width path); None: no layer to trim
        fb.plans[PLAN_KEY] = DecoderRows(*(view(name) for name in _KEEP), view("keep_replay_start_t"),
                                         view("keep_logits_rows")) if self.trims else None
