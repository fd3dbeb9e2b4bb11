"""The paged hybrid KV cache: one block pool per cache kind.

DeepSeek-V4 keeps three kinds of per-sequence state per layer:
- window KV: the last `sliding_window` tokens' latents. Blocks that slide fully out of
  the window go back to the pool at once, so a sequence holds O(window) of it.
- compressed KV (one entry per `ratio` tokens, per compressed layer) and the indexer's
  keys (CSA layers): kept for the whole sequence. One "full" block covers `block_size`
  tokens, i.e. `block_size / ratio` entries of every compressed layer, so block
  boundaries close a block of every compressor (what prefix caching needs).
- compressor rolling state: the not-yet-complete block's projections and (CSA) the
  previous block's overlap slice; fixed size, one slot per running sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.models.config import CSA, DeepseekConfig


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    """Free list plus refcounts. Unreferenced blocks keep their contents (a prefix-cache hit can
    take them back) until allocation reuses them, least recently released first; `on_evict`
    then tells the prefix cache the block's old contents are gone."""

    def __init__(self, num_blocks: int, name: str):
        self.name = name
        self.num_blocks = num_blocks
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        if not self.free_ids:
            raise NoFreeBlocks(self.name)
        block, _ = self.free_ids.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block)
        self.refcount[block] = 1
        return block

    def retain(self, block: int) -> None:
        """Take one more reference (a free block leaves the free list with its contents)."""
        if self.refcount[block] == 0:
            del self.free_ids[block]
        self.refcount[block] += 1

    def release(self, block: int) -> bool:
        """Drop one reference; True when the block became unreferenced."""
        self.refcount[block] -= 1
        assert self.refcount[block] >= 0, f"{self.name}: double free of block {block}"
        if self.refcount[block] == 0:
            self.free_ids[block] = None
            return True
        return False


@dataclass
class CompressorState:
    """Rolling state of one compressor (per layer), indexed by a sequence's state slot."""

    pend_kv: torch.Tensor  # [slots, ratio, c * head_dim] projections of the open block
    pend_gate: torch.Tensor  # [slots, ratio, c * head_dim] fp32, position bias added
    prev_kv: torch.Tensor | None = None  # [slots, ratio, head_dim] CSA: Ca slice of the last closed block
    prev_gate: torch.Tensor | None = None
    has_prev: torch.Tensor | None = None  # [slots] bool
    # prefix caching: the overlap slice at the end of each full block, so a hit can resume
    bnd_kv: torch.Tensor | None = None  # [full blocks, ratio, head_dim]
    bnd_gate: torch.Tensor | None = None


@dataclass
class SeqBlocks:
    """A sequence's view of the cache: its block tables and state slot."""

    window_table: list[int] = field(default_factory=list)  # logical window block -> block id, -1 freed
    full_table: list[int] = field(default_factory=list)  # logical token block -> full block id
    state_slot: int = -1


class KVCache:
    """Device tensors of every pool plus their allocators."""

    # tensor parallel: the writes made outside the model's forward (below, "state writes"), as
    # (method, args), for the other ranks' caches to replay before the next step; None: not kept
    mirror: list[tuple[str, tuple]] | None = None

    def __init__(self, cfg: DeepseekConfig, block_size: int, num_window_blocks: int, num_full_blocks: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 boundary_state: bool = False, window_snapshots: bool = False):
        """boundary_state: keep CSA overlap state per full block (prefix caching);
        window_snapshots: also one window-KV snapshot per full block (prefix caching without
        bounded replay, the baseline)."""
        for r in cfg.compress_ratios:
            if r and block_size % r:
                raise ValueError(f"block_size={block_size} must be a multiple of every compress ratio "
                                 f"{sorted(set(cfg.compress_ratios) - {0})}")
        self.cfg, self.block_size, self.dtype, self.device = cfg, block_size, dtype, device
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        # one scratch block per pool and one scratch slot, never handed out: the padding rows of
        # a CUDA-graph batch write there
        self.scratch_window, self.scratch_full, self.scratch_slot = num_window_blocks, num_full_blocks, max_num_seqs
        num_window_blocks, num_full_blocks, max_num_seqs = num_window_blocks + 1, num_full_blocks + 1, max_num_seqs + 1
        self.window = [torch.zeros(num_window_blocks, block_size, hd, dtype=dtype, device=device)
                       for _ in range(cfg.num_layers)]
        self.compressed: list[torch.Tensor | None] = []
        self.index_keys: list[torch.Tensor | None] = []
        self.comp_state: list[CompressorState | None] = []
        self.index_state: list[CompressorState | None] = []
        for layer, r in enumerate(cfg.compress_ratios):
            csa = cfg.layer_types[layer] == CSA
            if not r:
                self.compressed.append(None)
                self.index_keys.append(None)
                self.comp_state.append(None)
                self.index_state.append(None)
                continue
            per_block = block_size // r
            self.compressed.append(torch.zeros(num_full_blocks, per_block, hd, dtype=dtype, device=device))
            self.comp_state.append(self._state(max_num_seqs, r, hd, csa, boundary_state and num_full_blocks))
            if csa:
                self.index_keys.append(torch.zeros(num_full_blocks, per_block, ihd, dtype=dtype, device=device))
                self.index_state.append(self._state(max_num_seqs, r, ihd, True, boundary_state and num_full_blocks))
            else:
                self.index_keys.append(None)
                self.index_state.append(None)
        W = cfg.sliding_window
        self.snapshots = (torch.zeros(num_full_blocks, cfg.num_layers, max(W - 1, 1), hd, dtype=dtype, device=device)
                          if window_snapshots else None)
        self.window_pool = BlockPool(self.scratch_window, "window")
        self.full_pool = BlockPool(self.scratch_full, "compressed")
        self.free_slots: deque[int] = deque(range(self.scratch_slot))
        self.max_num_seqs = self.scratch_slot

    def _state(self, slots: int, ratio: int, head_dim: int, overlap: bool, boundary_blocks: int = 0) -> CompressorState:
        c = 2 if overlap else 1
        z = dict(dtype=self.dtype, device=self.device)
        f = dict(dtype=torch.promote_types(self.dtype, torch.float32), device=self.device)
        st = CompressorState(torch.zeros(slots, ratio, c * head_dim, **z), torch.zeros(slots, ratio, c * head_dim, **f))
        if overlap:
            st.prev_kv = torch.zeros(slots, ratio, head_dim, **z)
            st.prev_gate = torch.zeros(slots, ratio, head_dim, **f)
            st.has_prev = torch.zeros(slots, dtype=torch.bool, device=self.device)
            if boundary_blocks:
                st.bnd_kv = torch.zeros(boundary_blocks, ratio, head_dim, **z)
                st.bnd_gate = torch.zeros(boundary_blocks, ratio, head_dim, **f)
        return st

    # --- byte accounting (sizing and the replay-vs-snapshot report) ---------------------------

    def full_block_bytes(self) -> int:
        """Compressed KV + indexer keys + boundary compressor state of one full block."""
        n = sum(t[0].numel() * t.element_size() for t in self.compressed + self.index_keys if t is not None)
        for st in self.comp_state + self.index_state:
            if st is not None and st.bnd_kv is not None:
                n += st.bnd_kv[0].numel() * st.bnd_kv.element_size() + st.bnd_gate[0].numel() * st.bnd_gate.element_size()
        return n

    def snapshot_bytes(self) -> int:
        return 0 if self.snapshots is None else self.snapshots[0].numel() * self.snapshots.element_size()

    @staticmethod
    def bytes_per_block(cfg: DeepseekConfig, block_size: int, dtype: torch.dtype, boundary_state: bool = False,
                        window_snapshots: bool = False) -> tuple[int, int]:
        """(window block bytes, full block bytes incl. its prefix-cache extras) without allocating."""
        el = torch.empty((), dtype=dtype).element_size()
        el32 = max(el, 4)
        window = cfg.num_layers * block_size * cfg.head_dim * el
        full = cfg.num_layers * max(cfg.sliding_window - 1, 1) * cfg.head_dim * el if window_snapshots else 0
        for layer, r in enumerate(cfg.compress_ratios):
            if r:
                full += (block_size // r) * cfg.head_dim * el
                if cfg.layer_types[layer] == CSA:
                    full += (block_size // r) * cfg.index_head_dim * el
                    if boundary_state:
                        full += r * (cfg.head_dim + cfg.index_head_dim) * (el + el32)
        return window, full

    # --- slots --------------------------------------------------------------------------------

    def allocate_slot(self) -> int:
        if not self.free_slots:
            raise NoFreeBlocks("state slots")
        slot = self.free_slots.popleft()
        self.reset_slot(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    # --- state writes outside the forward (mirrored to the other tensor-parallel ranks) --------

    def _record(self, op: str, *args) -> None:
        if self.mirror is not None:
            self.mirror.append((op, args))

    def reset_slot(self, slot: int) -> None:
        """A fresh state slot: no previous compressed block."""
        self._record("reset_slot", slot)
        for st in self.comp_state + self.index_state:
            if st is not None and st.has_prev is not None:
                st.has_prev[slot] = False

    def restore_boundary(self, slot: int, block: int) -> None:
        """Prefix-cache hit: the CSA overlap state at the end of full block `block` into `slot`."""
        self._record("restore_boundary", slot, block)
        for st in self.comp_state + self.index_state:
            if st is not None and st.bnd_kv is not None:
                st.prev_kv[slot], st.prev_gate[slot] = st.bnd_kv[block], st.bnd_gate[block]
                st.has_prev[slot] = True

    def _window_slots(self, window_table: list[int], lo: int, hi: int) -> torch.Tensor:
        table = torch.tensor(window_table, dtype=torch.long, device=self.device)
        pos = torch.arange(lo, hi, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def restore_window(self, window_table: list[int], lo: int, hi: int, block: int) -> None:
        """Prefix-cache hit without bounded replay: window KV [lo, hi) from block's snapshot."""
        self._record("restore_window", list(window_table), lo, hi, block)
        slots = self._window_slots(window_table, lo, hi)
        for layer in range(self.cfg.num_layers):
            self.write_window(layer, slots, self.snapshots[block, layer, self.snapshots.shape[2] - (hi - lo):])

    def snapshot_window(self, block: int, window_table: list[int], lo: int, hi: int) -> None:
        """Window KV of positions [lo, hi) into block's snapshot (its end, every layer)."""
        self._record("snapshot_window", block, list(window_table), lo, hi)
        table = torch.tensor(window_table, dtype=torch.long, device=self.device)
        for layer in range(self.cfg.num_layers):
            self.snapshots[block, layer, self.snapshots.shape[2] - (hi - lo):] = self.read_window(layer, table, lo, hi)

    # --- reads and writes used by the model ---------------------------------------------------

    def write_window(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """slots [T] = block_id * block_size + offset."""
        self.window[layer].view(-1, kv.shape[-1]).index_copy_(0, slots, kv.to(self.dtype))

    def read_window(self, layer: int, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=table.device)
        flat = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.window[layer].view(-1, self.window[layer].shape[-1])[flat]

    # --- per-sequence block allocation (the scheduler asks, the runner reads the tables) ------

    def _window_span(self, lo: int, hi: int) -> range:
        return range(lo // self.block_size, (hi - 1) // self.block_size + 1) if hi > lo else range(0)

    def blocks_needed(self, seq: SeqBlocks, lo: int, hi: int) -> tuple[int, int]:
        """(window, full) blocks to allocate so a step can read window [lo, hi) and write up to hi."""
        window = sum(1 for b in self._window_span(lo, hi) if b >= len(seq.window_table) or seq.window_table[b] < 0)
        full = max(0, -(-hi // self.block_size) - len(seq.full_table))
        return window, full

    def can_allocate(self, seq: SeqBlocks, lo: int, hi: int) -> bool:
        w, f = self.blocks_needed(seq, lo, hi)
        return (w <= self.window_pool.num_free and f <= self.full_pool.num_free
                and (seq.state_slot >= 0 or self.free_slots))

    def allocate(self, seq: SeqBlocks, lo: int, hi: int) -> None:
        if not self.can_allocate(seq, lo, hi):
            raise NoFreeBlocks("not enough blocks for the step")
        if seq.state_slot < 0:
            seq.state_slot = self.allocate_slot()
        for b in self._window_span(lo, hi):
            while len(seq.window_table) <= b:
                seq.window_table.append(-1)
            if seq.window_table[b] < 0:
                seq.window_table[b] = self.window_pool.allocate()
        while len(seq.full_table) * self.block_size < hi:
            seq.full_table.append(self.full_pool.allocate())

    def release_window_below(self, seq: SeqBlocks, pos: int) -> None:
        """Return window blocks holding only positions < pos (they slid out of every window)."""
        for b in range(min(pos // self.block_size, len(seq.window_table))):
            if seq.window_table[b] >= 0:
                self.window_pool.release(seq.window_table[b])
                seq.window_table[b] = -1

    def free(self, seq: SeqBlocks) -> None:
        for b in seq.window_table:
            if b >= 0:
                self.window_pool.release(b)
        for b in seq.full_table:
            self.full_pool.release(b)
        if seq.state_slot >= 0:
            self.release_slot(seq.state_slot)
        seq.window_table, seq.full_table, seq.state_slot = [], [], -1
