"""Turns scheduled sequences into one packed ForwardBatch, runs the model, returns logits.

Decode steps (one token per sequence) on CUDA replay a CUDA graph captured per batch-size
bucket: the batch is padded to the bucket with rows that read and write only the cache's
scratch block and slot, its metadata copied into the graph's static buffers.
"""

from __future__ import annotations

import torch

from backend.engine.cache import KVCache
from backend.engine.forward_batch import ForwardBatch
from backend.engine.model import DeepseekV4
from backend.engine.sequence import Sequence

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def _pad(rows: list[list[int]], value: int, width: int | None = None) -> list[list[int]]:
    width = width or max(1, max(len(r) for r in rows))
    return [r + [value] * (width - len(r)) for r in rows]


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: KVCache, max_model_len: int | None = None,
                 cuda_graphs: bool = False, max_num_seqs: int = 0):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]] = {}
        if cuda_graphs and self.device.type == "cuda":
            self._capture([b for b in GRAPH_BUCKETS if b <= max_num_seqs])

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
        n = len(scheduled)
        if self.graphs and not all_logits and n <= max(self.graphs) and all(
                k == 1 and s.num_computed_tokens == s.num_tokens - 1 and s.compress_from == s.num_computed_tokens
                for s, k in scheduled):
            return self._replay(scheduled)
        return self.model(self.build_batch(scheduled, all_logits), self.cache)

    # --- CUDA graphs for decode ---------------------------------------------------------------

    def _table_width(self) -> int:
        return -(-self.max_model_len // self.cache.block_size) + 1

    def _padding_batch(self, size: int) -> ForwardBatch:
        """Every row a padding row: scratch block, scratch slot, position 0."""
        c, dev, width = self.cache, self.device, self._table_width()
        z = lambda v: torch.full((size,), v, dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=z(0), positions=z(0), seq_lens=[1] * size, starts=[0] * size, replay_starts=[0] * size,
            compress_from=[0] * size, window_slots=z(c.scratch_window * c.block_size),
            window_tables=torch.full((size, width), c.scratch_window, dtype=torch.long, device=dev),
            full_tables=torch.full((size, width), c.scratch_full, dtype=torch.long, device=dev),
            state_slots=[c.scratch_slot] * size, logits_rows=torch.arange(size, device=dev),
            token_seq=torch.arange(size, device=dev), replay_start_t=z(0), state_slot_t=z(c.scratch_slot),
            is_decode=True, max_pos=self.max_model_len - 1)  # the indexer sizes for the longest sequence

    def _capture(self, buckets: list[int]) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its memory
            fb = self._padding_batch(size)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (Triton JIT, allocator)
                    self.model(fb, self.cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(fb, self.cache)
            self.graphs[size] = (graph, fb, logits)
        torch.cuda.synchronize()

    def _replay(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        n, c = len(scheduled), self.cache
        size = min(b for b in self.graphs if b >= n)
        graph, fb, logits = self.graphs[size]
        bs, width = c.block_size, self._table_width()
        pos = [s.num_computed_tokens for s, _ in scheduled]
        pad = size - n
        wt = _pad([s.blocks.window_table for s, _ in scheduled], -1, width) + [[c.scratch_window] * width] * pad
        ft = _pad([s.blocks.full_table for s, _ in scheduled], 0, width) + [[c.scratch_full] * width] * pad
        host = torch.tensor(
            [[s.token_ids[p] for (s, _), p in zip(scheduled, pos)] + [0] * pad,
             pos + [0] * pad,
             [s.blocks.window_table[p // bs] * bs + p % bs for (s, _), p in zip(scheduled, pos)]
             + [c.scratch_window * bs] * pad,
             [s.replay_start for s, _ in scheduled] + [0] * pad,
             [s.blocks.state_slot for s, _ in scheduled] + [c.scratch_slot] * pad], dtype=torch.long)
        host = host.pin_memory() if torch.cuda.is_available() else host
        dev = host.to(self.device, non_blocking=True)
        fb.input_ids.copy_(dev[0])
        fb.positions.copy_(dev[1])
        fb.window_slots.copy_(dev[2])
        fb.replay_start_t.copy_(dev[3])
        fb.state_slot_t.copy_(dev[4])
        fb.window_tables.copy_(torch.tensor(wt, dtype=torch.long).to(self.device, non_blocking=True))
        fb.full_tables.copy_(torch.tensor(ft, dtype=torch.long).to(self.device, non_blocking=True))
        graph.replay()
        return logits[:n]
