"""Continuous batching: who runs this step and with how many tokens.

Each step mixes decodes and prefill chunks under `max_num_batched_tokens` and
`max_num_seqs`: running sequences' decodes first (one token each, so a step's decode work never
waits behind a prefill), then running sequences' prefill chunks, then waiting ones in arrival
order (no overtaking). `long_prefill_token_threshold` (vLLM's) caps one sequence's chunk, so a
long prompt shares a step's budget with the next prompts. The budget bounds a step's tokens, hence
its time and every stream's inter-token latency (suite mixed_budget, docs/PERF.md). When blocks run
out, the newest running sequence is preempted by recompute: its blocks go back and it re-queues at
the front, later re-prefilling its prompt plus what it already generated, so its output is unchanged.
`chunk_budget` (engine/chunk_budget.py) may choose a smaller budget per step from the queue: long
chunks while few decodes run, short ones while many do; `max_num_batched_tokens` stays the cap.
Where mixed steps replay CUDA graphs (`graph_sizes`, the runner's), a step's newest prefill chunk is cut
back to a captured size when the padding would cost more than one more small step
(engine/graphs/aligned_chunks.py).
"""

from __future__ import annotations

import time
from collections import deque

from engine.cache import KVCache
from engine.chunk_budget import ChunkBudget, ChunkBudgetConfig
from engine.graphs.aligned_chunks import aligned
from engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, sliding_window: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache=None, long_prefill_token_threshold: int = 0,
                 chunk_budget: ChunkBudgetConfig | None = None):
        self.cache, self.window = cache, sliding_window
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.chunk_budget = ChunkBudget(chunk_budget or ChunkBudgetConfig(), max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.graph_sizes: list[int] = []  # the mixed-step graphs' token counts (the engine sets them after capture)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _window_lo(self, seq: Sequence) -> int:
        return max(0, seq.num_computed_tokens - self.window + 1, seq.replay_start)

    def _try_allocate(self, seq: Sequence, n: int) -> bool:
        if n == 1 and seq.num_computed_tokens % self.cache.block_size and seq.blocks.state_slot >= 0:
            return True  # a decode inside a block its last step already holds (and the window's too)
        lo, hi = self._window_lo(seq), seq.num_computed_tokens + n
        if not self.cache.can_allocate(seq.blocks, lo, hi):
            return False
        self.cache.allocate(seq.blocks, lo, hi)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = seq.compress_from = seq.replay_start = seq.num_cached_tokens = 0
        seq.registered_blocks, seq.pending_restore = 0, False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        scheduled = self._schedule()
        if self.graph_sizes:
            cut = aligned(scheduled, self.graph_sizes)
            # prompt_logprobs steps run eagerly (every row's logits): no padding to save (scanned only for a cut)
            if cut is not scheduled and all(s.sampling.prompt_logprobs is None for s, _ in scheduled):
                scheduled = cut
        if self.chunk_budget.adaptive:  # the step's makeup times its interval (a fixed budget learns nothing)
            decodes = sum(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in scheduled)
            self.chunk_budget.scheduled(decodes, sum(n for _, n in scheduled) - decodes)
        return scheduled

    def _schedule(self) -> list[tuple[Sequence, int]]:
        scheduled: list[tuple[Sequence, int]] = []
        kept: list[Sequence] = []
        # decodes (one token owed) first, each group in running order (a stable sort)
        queue = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens != 1)
        budget = self.max_num_batched_tokens
        if self.chunk_budget.adaptive:  # the queue's makeup: a scan per step that the fixed budget has no use for
            decodes = next((i for i, s in enumerate(queue) if s.num_tokens - s.num_computed_tokens != 1), len(queue))
            budget = self.chunk_budget.budget(decodes, len(queue) - decodes + len(self.waiting), budget)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk)
            while not self._try_allocate(seq, n):
                victim = queue.pop() if queue else None
                if victim is None:  # nothing newer to evict: give way ourselves
                    self._preempt(seq)
                    break
                self._preempt(victim)
            else:
                scheduled.append((seq, n))
                kept.append(seq)
                budget -= n
        kept.extend(queue)  # not scheduled this step (budget spent) but still running
        self.running = kept
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.has_pending_token:  # preempted while its last token is in flight: not before it lands
                break
            # prompt_logprobs need every position computed: no prefix-cache read (as vLLM)
            if seq.num_computed_tokens == 0 and self.prefix_cache is not None and seq.sampling.prompt_logprobs is None:
                self.prefix_cache.match(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk)
            if not self._try_allocate(seq, n):
                if self.prefix_cache is not None:
                    self.prefix_cache.unmatch(seq)
                break
            if self.prefix_cache is not None:
                self.prefix_cache.restore(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def advance(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After the forward: record progress and return window blocks that slid out."""
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            seq.compress_from = max(seq.compress_from, seq.num_computed_tokens)
            self.cache.release_window_below(seq.blocks, seq.num_computed_tokens - self.window + 1)
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq)

    def release(self, seq: Sequence) -> None:
        self.cache.free(seq.blocks)  # cached blocks stay reusable until the pool hands them out

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if not self.has_unfinished():
            self.chunk_budget.idle()
