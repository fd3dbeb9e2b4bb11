"""Turns scheduled sequences into one packed ForwardBatch, runs the model, returns logits.

Decode steps (one token per sequence) on CUDA replay a CUDA graph captured per batch-size
bucket: the batch is padded to the bucket with rows that read and write only the cache's
scratch block and slot, its metadata copied into the graph's static buffers. Other steps
(prefill chunks, mixed prefill + decode) replay a graph per token count: engine/graphs/mixed.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.cache import KVCache
from engine.forward_batch import DEAD, ForwardBatch, HostBatch, lookback_rows
from engine.graphs.capture import capture
from engine.graphs.mixed import MixedStepGraphs
from engine.graphs.staging import StagingPair
from engine.graphs.static_batch import new_token_ids
from engine.models.family import ModelFamily
from engine.sequence import Sequence

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes of the decode graphs: the buckets below max_num_seqs and max_num_seqs itself, so every decode
    batch the scheduler can form replays one. Without the last, a batch between the largest bucket and
    max_num_seqs (129-150 at 150) ran as a mixed-step graph padded to the next token count (256) or, with mixed
    graphs off, eagerly."""
    return [b for b in GRAPH_BUCKETS if b < max_num_seqs] + [max_num_seqs]


def _ends(scheduled: list[tuple[Sequence, int]]) -> list[int]:
    """Row after each sequence's last token in the packed batch."""
    out, row = [], 0
    for _, n in scheduled:
        row += n
        out.append(row)
    return out


def _pad(rows: list[list[int]], value: int, width: int | None = None) -> list[list[int]]:
    width = width or max(1, max(len(r) for r in rows))
    return [r + [value] * (width - len(r)) for r in rows]


@dataclass
class DecodeGraph:
    """One batch-size bucket's decode graph and the static buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph | None  # None: the static batch only (static_decode_batches, the CPU)
    batch: ForwardBatch  # views of flat: the graph reads its tensors
    flat: torch.Tensor  # the whole batch's metadata, refreshed by one copy per replay
    stagings: StagingPair  # two pinned host buffers, used by alternate steps
    logits: torch.Tensor | None  # what the graph writes


class ModelRunner:
    def __init__(self, model: ModelFamily, cache: KVCache, max_model_len: int | None = None,
                 cuda_graphs: bool = False, max_num_seqs: int = 0, mixed_sizes: list[int] = ()):
        """mixed_sizes: token counts of the mixed-step graphs (none: such steps run eagerly)."""
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len
        self.graphs: dict[int, DecodeGraph] = {}  # batch-size bucket -> its decode graph
        self.replays = 0
        self.eager_steps = 0
        self.mixed: MixedStepGraphs | None = None
        self.workers = None  # tensor parallel (engine/tp_workers.py): ranks 1..N-1 get every step
        if cuda_graphs and self.device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()  # one pool: mixed graphs (the largest) first
            if mixed_sizes:
                self.mixed = MixedStepGraphs(model, cache, max_model_len, max_num_seqs, mixed_sizes, pool)
            self._capture(decode_buckets(max_num_seqs), pool)

    def build_batch(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> ForwardBatch:
        """scheduled: (sequence, number of new tokens) in batch order; a sequence's tokens are its
        token_ids then its spec_token_ids (drafts to verify). Logits come for each row from a
        sequence's last known token on (it samples next), or every row."""
        fb = self.host_batch(scheduled, all_logits).to_device(self.device)
        lookback = self.lookback_ids(scheduled)
        fb.lookback_ids = None if lookback is None else lookback.to(self.device)
        return fb

    def lookback_ids(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor | None:
        """V4.1 Engram: the tokens before each row [T, k] on the host (never a pending one); None: no Engram."""
        k = self.model.lookback_tokens
        if not k:
            return None
        return torch.cat([lookback_rows(seq.token_ids, seq.num_computed_tokens, n, k) for seq, n in scheduled])

    def host_batch(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> HostBatch:
        """build_batch's ForwardBatch fields as host lists."""
        bs = self.cache.block_size
        ids, pos, slots, rows = [], [], [], []
        seq_lens, starts, replay, cfrom, wt, ft, st = [], [], [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend((seq.token_ids + seq.spec_token_ids)[start:start + n])  # drafts ride after the last token
            p = range(start, start + n)
            pos.extend(p)
            slots.extend(seq.blocks.window_table[i // bs] * bs + i % bs for i in p)
            if all_logits:
                rows.extend(range(len(pos) - n, len(pos)))
            elif start + n >= seq.num_tokens:  # from its last known token on (k + 1 rows when verifying k drafts)
                rows.extend(range(len(pos) - (start + n - seq.num_tokens) - 1, len(pos)))
            seq_lens.append(n)
            starts.append(start)
            replay.append(seq.replay_start)
            cfrom.append(max(seq.compress_from, start))
            wt.append(seq.blocks.window_table)
            ft.append(seq.blocks.full_table)
            st.append(seq.blocks.state_slot)
        token_seq = [s for s, n in enumerate(seq_lens) for _ in range(n)]
        is_decode = all(n == 1 for n in seq_lens) and cfrom == starts
        return HostBatch(input_ids=ids, positions=pos, seq_lens=seq_lens, starts=starts, replay_starts=replay,
                         compress_from=cfrom, window_slots=slots, window_tables=_pad(wt, -1), full_tables=_pad(ft, 0),
                         state_slots=st, logits_rows=rows, token_seq=token_seq, replay_start_t=replay, state_slot_t=st,
                         is_decode=is_decode, max_pos=max(pos))

    def run(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False,
            pending: tuple[torch.Tensor, dict[int, int]] | None = None,
            prompt_rows=None) -> torch.Tensor:
        """pending: (token ids of the step still in flight, on the device; id(seq) -> its row
        there). A sequence whose last token is still pending reads it from there (async
        scheduling): the ids never make a round trip through the host. prompt_rows: an
        engine.prompt_logprobs.PromptLogprobRows: an eager step that also keeps those rows' hidden states."""
        if prompt_rows is None and self._decode_graph(scheduled, all_logits):
            return self._replay(scheduled, pending)
        if prompt_rows is None and self.mixed is not None and self.mixed.fits(scheduled, all_logits):
            return self.mixed.run(scheduled, pending, self._fill_pending)
        self.eager_steps += 1
        if self.workers is not None:  # tensor parallel: the workers get the host lists (and the Engram look-back)
            host, lookback = self.host_batch(scheduled, all_logits), self.lookback_ids(scheduled)
            self.workers.step_eager(host, lookback)
            fb = host.to_device(self.device)
            fb.lookback_ids = None if lookback is None else lookback.to(self.device)
        else:
            fb = self.build_batch(scheduled, all_logits)
        self._fill_pending(fb.input_ids, scheduled, pending, [r - 1 for r in _ends(scheduled)])
        if prompt_rows is not None:  # prompt_logprobs: their rows' streams go to the LM head later, in slices
            h = self.model.hidden_states(fb, self.cache)
            prompt_rows.hidden = h[prompt_rows.rows]
            return self.model.compute_logits(h[fb.logits_rows])
        return self.model(fb, self.cache)

    def replays_graph(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> bool:
        """The step replays a CUDA graph (decode or mixed)."""
        return self._decode_graph(scheduled, all_logits) or (self.mixed is not None and self.mixed.fits(scheduled, all_logits))

    def _decode_graph(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False) -> bool:
        """A decode step within the largest captured batch: replayed as a CUDA graph."""
        return bool(self.graphs) and not all_logits and len(scheduled) <= max(self.graphs) and all(
            k == 1 and s.num_computed_tokens == s.num_tokens - 1 and s.compress_from == s.num_computed_tokens
            for s, k in scheduled)

    def _fill_pending(self, input_ids: torch.Tensor, scheduled: list[tuple[Sequence, int]],
                      pending: tuple[torch.Tensor, dict[int, int]] | None, last_rows: list[int]) -> None:
        """Write the in-flight step's tokens into the rows that carry a placeholder."""
        pairs = []
        for (s, n), row in zip(scheduled, last_rows):
            if s.has_pending_token:
                assert pending is not None and s.num_computed_tokens + n == s.num_tokens, "pending token unreachable"
                pairs.append((row, pending[1][id(s)]))
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.long).T.contiguous()
        if input_ids.is_cuda:
            idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
        input_ids[idx[0]] = pending[0][idx[1]]

    # --- CUDA graphs for decode ---------------------------------------------------------------

    def _table_width(self) -> int:
        return -(-self.max_model_len // self.cache.block_size) + 1

    def _padding_batch(self, size: int) -> tuple[ForwardBatch, torch.Tensor]:
        """Every row a padding row: scratch block, scratch slot, position 0. The batch's tensors
        are contiguous views of one flat buffer (ids, positions, window slots, replay starts, state
        slots, window tables, full tables, then V4.1's Engram look-back ids), so each replay
        refreshes them with a single copy."""
        c, dev, width = self.cache, self.device, self._table_width()
        k = self.model.lookback_tokens
        flat = torch.empty(size * (5 + 2 * width + k), dtype=torch.long, device=dev)
        col = [flat[i * size:(i + 1) * size] for i in range(5)]
        tables = flat[5 * size:(5 + 2 * width) * size].view(2, size, width)
        lookback = flat[(5 + 2 * width) * size:].view(size, k).fill_(DEAD) if k else None
        for t, v in zip(col, (0, 0, c.scratch_window * c.block_size, 0, c.scratch_slot)):
            t.fill_(v)
        tables[0].fill_(c.scratch_window)
        tables[1].fill_(c.scratch_full)
        fb = ForwardBatch(
            input_ids=col[0], positions=col[1], seq_lens=[1] * size, starts=[0] * size, replay_starts=[0] * size,
            compress_from=[0] * size, window_slots=col[2], window_tables=tables[0], full_tables=tables[1],
            state_slots=[c.scratch_slot] * size, logits_rows=torch.arange(size, device=dev),
            token_seq=torch.arange(size, device=dev), replay_start_t=col[3], state_slot_t=col[4],
            is_decode=True, max_pos=self.max_model_len - 1,  # the indexer sizes for the longest sequence
            lookback_ids=lookback)
        return fb, flat

    def static_decode_batches(self, buckets: list[int]) -> None:
        """The decode graphs' padded static batches without capturing them: decode steps then run
        eagerly on exactly what a replay would read (how the CPU tests check it)."""
        self._capture(buckets, None)

    def _capture(self, buckets: list[int], pool, capture_fn=capture) -> None:
        """pool None: build the static batches only (graph and logits None). capture_fn: the CPU tests
        pass an emulation of a CUDA graph."""
        cuda = self.device.type == "cuda"
        for size in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its memory
            fb, flat = self._padding_batch(size)
            graph, logits = None, None
            if pool is not None:
                self.prefetch_host_inputs(size, flat.cpu().numpy())  # host-fed inputs exist before the graph reads them
                graph, logits = capture_fn(lambda fb=fb: self.model(fb, self.cache), pool)
            # two pinned staging buffers, used by alternate steps: with async scheduling step N+1
            # is packed while step N's copy may still wait behind step N-1 on the GPU
            self.graphs[size] = DecodeGraph(graph, fb, flat, StagingPair(flat.shape, pool is not None and cuda), logits)
        if pool is not None and cuda:
            torch.cuda.synchronize()

    def pack_decode(self, scheduled: list[tuple[Sequence, int]], size: int, host: np.ndarray) -> None:
        """Write a decode batch, padded to `size` rows, into `host` in the flat layout of
        _padding_batch (what build_batch would give for the real rows)."""
        c, n = self.cache, len(scheduled)
        bs, width = c.block_size, self._table_width()
        k = self.model.lookback_tokens
        cols = host[:5 * size].reshape(5, size)
        tables = host[5 * size:(5 + 2 * width) * size].reshape(2, size, width)
        tables[0, :n], tables[1, :n] = -1, 0  # then each row's blocks over the fill
        if k:  # V4.1 Engram: the k tokens before each row, nearest first (known on the host: only the row's own may pend)
            lookback = host[(5 + 2 * width) * size:].reshape(size, k)
            lookback[:] = DEAD
        rows = []
        for i, (s, _) in enumerate(scheduled):
            p, b = s.num_computed_tokens, s.blocks
            wt, ft = b.window_table, b.full_table
            rows.append((s.last_token_id, p, wt[p // bs] * bs + p % bs, s.replay_start, b.state_slot))
            tables[0, i, :len(wt)] = wt
            tables[1, i, :len(ft)] = ft
            if k and p:
                lookback[i, :min(p, k)] = new_token_ids(s, max(0, p - k), min(p, k))[::-1]
        if n:
            cols[:, :n] = np.array(rows, dtype=np.int64).T  # one conversion, not a numpy write per row
        cols[:, n:] = np.array([0, 0, c.scratch_window * bs, 0, c.scratch_slot])[:, None]
        tables[0, n:] = c.scratch_window
        tables[1, n:] = c.scratch_full

    def prefetch_host_inputs(self, size: int, host: np.ndarray) -> None:
        """A model that reads host memory per step (V4.1's Engram tables memory-mapped) gets a decode
        graph's packed ids and look-back before its capture (the padding batch) and before each replay
        (tensor-parallel workers call it on rank 0's buffer)."""
        if self.model.needs_host_tokens:
            k = self.model.lookback_tokens
            self.model.prefetch_host_inputs(size, host[:size], host[(5 + 2 * self._table_width()) * size:].reshape(size, k))

    def _replay(self, scheduled: list[tuple[Sequence, int]],
                pending: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """Pack into a pinned staging buffer, one host-to-device copy, replay. A buffer is packed
        again two replays later, by when the engine has read back (so waited for) the step that
        copied from it."""
        n = len(scheduled)
        size = min(b for b in self.graphs if b >= n)
        g = self.graphs[size]
        self.replays += 1
        staging = g.stagings.next()  # the other one may still be on its way to the GPU
        self.pack_decode(scheduled, size, staging.numpy())
        if g.graph is not None:  # static batches without a graph run eagerly: they gather as any eager step
            self.prefetch_host_inputs(size, staging.numpy())
        if self.workers is not None:
            self.workers.step_graph(size, staging.numpy())
        g.flat.copy_(staging, non_blocking=True)
        self._fill_pending(g.batch.input_ids, scheduled, pending, list(range(n)))
        if g.graph is None:  # static batches without a graph (static_decode_batches)
            return self.model(g.batch, self.cache)[:n]
        g.graph.replay()
        return g.logits[:n]
