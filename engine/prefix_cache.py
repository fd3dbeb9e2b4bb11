"""Prefix caching over full blocks, with SWA bounded replay.

A full block covers `block_size` tokens, a multiple of every compress ratio, so its end
closes a block of every compressor: its compressed KV, indexer keys and the CSA overlap
state at its end are exact to reuse. Blocks are hash-chained (parent hash, tokens) and
stay reusable after their sequences finish until the pool hands them out again (LRU).

Sliding-window KV is the expensive part to keep per boundary. Two modes:
- bounded replay (`swa_bounded_replay`, default): window KV is never cached. A hit ending
  at H reuses everything exact below H and recomputes only [H - W, H) to rebuild every
  layer's window; those replayed tokens read no window KV below `replay_start = H - W`
  and write no compressed KV (it is cached). Hits of at most W tokens are not taken.
- snapshots (the baseline): one window-KV snapshot per cached boundary, restored on a hit.
"""

from __future__ import annotations

from engine.cache import KVCache
from engine.sequence import Sequence


class PrefixCache:
    def __init__(self, cache: KVCache, sliding_window: int, bounded_replay: bool):
        self.cache, self.window, self.bounded_replay = cache, sliding_window, bounded_replay
        self.block_size = cache.block_size
        self.hash_to_block: dict[int, int] = {}
        self.block_to_hash: dict[int, int] = {}
        cache.full_pool.on_evict = self._evict
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0,
                         "prefix_cache_replayed_tokens": 0}

    def _evict(self, block: int) -> None:
        h = self.block_to_hash.pop(block, None)
        if h is not None:
            del self.hash_to_block[h]

    def _hashes(self, tokens: list[int], n_blocks: int) -> list[int]:
        out, parent, bs = [], 0, self.block_size
        for b in range(n_blocks):
            parent = hash((parent, tuple(tokens[b * bs:(b + 1) * bs])))
            out.append(parent)
        return out

    # --- admission ----------------------------------------------------------------------------

    def match(self, seq: Sequence) -> None:
        """Take the longest cached prefix of a new sequence (leaving at least one token to run)."""
        bs, tokens = self.block_size, seq.token_ids
        n_blocks = (len(tokens) - 1) // bs
        self.counters["prefix_cache_queries"] += len(tokens)
        hit = []
        for h in self._hashes(tokens, n_blocks):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hit.append(block)
        H = len(hit) * bs
        if not hit or (self.bounded_replay and H <= self.window):
            return
        for block in hit:
            self.cache.full_pool.retain(block)
        seq.blocks.full_table = list(hit)
        seq.registered_blocks = len(hit)
        seq.num_cached_tokens = seq.compress_from = H
        if self.bounded_replay:
            seq.replay_start = seq.num_computed_tokens = H - self.window
        else:
            seq.num_computed_tokens = H
        seq.pending_restore = True

    def unmatch(self, seq: Sequence) -> None:
        """Admission failed after a match: give the blocks back, start over next time."""
        if not seq.pending_restore:
            return
        for block in seq.blocks.full_table:
            self.cache.full_pool.release(block)
        seq.blocks.full_table = []
        seq.num_cached_tokens = seq.compress_from = seq.replay_start = seq.num_computed_tokens = 0
        seq.registered_blocks = 0
        seq.pending_restore = False

    def restore(self, seq: Sequence) -> None:
        """After allocation: the CSA overlap state (and, for snapshots, the window KV) at H."""
        if not seq.pending_restore:
            return
        seq.pending_restore = False
        c, H = self.cache, seq.num_cached_tokens
        last = seq.blocks.full_table[H // self.block_size - 1]
        c.restore_boundary(seq.blocks.state_slot, last)
        if self.bounded_replay:
            self.counters["prefix_cache_replayed_tokens"] += H - seq.replay_start
        else:  # the next query at H reads window positions (H - W, H)
            c.restore_window(seq.blocks.window_table, max(0, H - self.window + 1), H, last)
        self.counters["prefix_cache_hits"] += 1
        self.counters["prefix_cache_hit_tokens"] += H

    # --- after each step ----------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks (their compressor blocks closed)."""
        bs, done = self.block_size, seq.compress_from // self.block_size
        start = seq.registered_blocks
        if done <= start:
            return
        hashes = self._hashes(seq.token_ids, done)
        for b in range(start, done):
            block = seq.blocks.full_table[b]
            if hashes[b] in self.hash_to_block or block in self.block_to_hash:
                continue  # someone cached the same prefix first (or it is a hit block)
            self.hash_to_block[hashes[b]] = block
            self.block_to_hash[block] = hashes[b]
            if not self.bounded_replay:
                self._snapshot(seq, block, (b + 1) * bs)
        seq.registered_blocks = done

    def _snapshot(self, seq: Sequence, block: int, H: int) -> None:
        """Window KV of positions [H - W + 1, H) at the boundary H, every layer."""
        self.cache.snapshot_window(block, seq.blocks.window_table, max(0, H - self.window + 1), H)

    def stats(self) -> dict:
        n = len(self.hash_to_block)
        return {**self.counters, "prefix_cache_blocks": n,
                "prefix_cache_bytes": {"compressed": n * self.cache.full_block_bytes(),
                                       "window_snapshots": n * self.cache.snapshot_bytes()}}
