"""Turns scheduled sequences into one packed ForwardBatch, runs the model, returns logits."""

from __future__ import annotations

import torch

from backend.engine.cache import KVCache
from backend.engine.forward_batch import ForwardBatch
from backend.engine.model import DeepseekV4
from backend.engine.sequence import Sequence


def _pad(rows: list[list[int]], value: int) -> list[list[int]]:
    width = max(1, max(len(r) for r in rows))
    return [r + [value] * (width - len(r)) for r in rows]


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: KVCache):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device

    def build_batch(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> ForwardBatch:
        """scheduled: (sequence, number of new tokens) in batch order. Logits come for each
        sequence whose chunk reaches its last known token (it samples next), or every row."""
        bs, dev = self.cache.block_size, self.device
        ids, pos, slots, rows = [], [], [], []
        seq_lens, starts, replay, cfrom, wt, ft, st = [], [], [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            p = range(start, start + n)
            pos.extend(p)
            slots.extend(seq.blocks.window_table[i // bs] * bs + i % bs for i in p)
            if all_logits:
                rows.extend(range(len(pos) - n, len(pos)))
            elif start + n == seq.num_tokens:
                rows.append(len(pos) - 1)
            seq_lens.append(n)
            starts.append(start)
            replay.append(seq.replay_start)
            cfrom.append(max(seq.compress_from, start))
            wt.append(seq.blocks.window_table)
            ft.append(seq.blocks.full_table)
            st.append(seq.blocks.state_slot)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        token_seq = [s for s, n in enumerate(seq_lens) for _ in range(n)]
        is_decode = all(n == 1 for n in seq_lens) and cfrom == starts
        return ForwardBatch(t(ids), t(pos), seq_lens, starts, replay, cfrom, t(slots), t(_pad(wt, -1)),
                            t(_pad(ft, 0)), st, t(rows), t(token_seq), t(replay), t(st), is_decode, max(pos))

    def run(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> torch.Tensor:
        return self.model(self.build_batch(scheduled, all_logits), self.cache)
