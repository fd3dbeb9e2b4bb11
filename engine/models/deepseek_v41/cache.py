"""The paged hybrid KV cache for DeepSeek-V4.1 (CSA2): same pools and allocator as V4's KVCache,
different contents.

- window KV: every layer, as in V4 (a sequence holds O(sliding_window) of it).
- compressed KV and indexer keys: only on KV-source layers (`kv_source_layer_ids`); every other
  layer reads its source's pool. One full block covers `block_size` tokens = `block_size / r`
  entries of a ratio-r source (r = 1: one latent per token).
- the open group of a ratio > 1 source (fp32 projections and gates of < r tokens), one slot per
  running sequence. Groups do not overlap in V4.1, so no boundary state is needed for prefix
  caching: a block end closes a group of every source.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.cache import BlockPool, CompressorState, KVCache
from engine.models.deepseek_v41.config import V41Config


class V41KVCache(KVCache):
    def __init__(self, cfg: V41Config, block_size: int, num_window_blocks: int, num_full_blocks: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 boundary_state: bool = False, window_snapshots: bool = False):
        if block_size % cfg.compress_block_lcm:
            raise ValueError(f"block_size={block_size} must be a multiple of every KV source's compress ratio "
                             f"({cfg.compress_block_lcm})")
        self.cfg, self.block_size, self.dtype, self.device = cfg, block_size, dtype, device
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        self.scratch_window, self.scratch_full, self.scratch_slot = num_window_blocks, num_full_blocks, max_num_seqs
        nw, nf, ns = num_window_blocks + 1, num_full_blocks + 1, max_num_seqs + 1
        z = dict(dtype=dtype, device=device)
        f32 = dict(dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.window = [torch.zeros(nw, block_size, hd, **z) for _ in range(cfg.num_layers)]
        self.compressed, self.index_keys, self.comp_state, self.index_state = [], [], [], []
        for layer in range(cfg.num_layers):
            r = cfg.compress_ratios[layer]
            source = layer in cfg.kv_source_layer_ids
            self.compressed.append(torch.zeros(nf, block_size // r, hd, **z) if source else None)
            self.index_keys.append(torch.zeros(nf, block_size // r, ihd, **z) if source else None)
            self.comp_state.append(CompressorState(torch.zeros(ns, r, hd, **f32), torch.zeros(ns, r, hd, **f32))
                                   if source and r > 1 else None)
            self.index_state.append(None)
        W = cfg.sliding_window
        self.snapshots = (torch.zeros(nf, cfg.num_layers, max(W - 1, 1), hd, **z) if window_snapshots else None)
        self.window_pool = BlockPool(self.scratch_window, "window")
        self.full_pool = BlockPool(self.scratch_full, "compressed")
        self.free_slots: deque[int] = deque(range(self.scratch_slot))
        self.max_num_seqs = self.scratch_slot

    @staticmethod
    def bytes_per_block(cfg: V41Config, block_size: int, dtype: torch.dtype, boundary_state: bool = False,
                        window_snapshots: bool = False) -> tuple[int, int]:
        el = torch.empty((), dtype=dtype).element_size()
        window = cfg.num_layers * block_size * cfg.head_dim * el
        full = cfg.num_layers * max(cfg.sliding_window - 1, 1) * cfg.head_dim * el if window_snapshots else 0
        for s in cfg.kv_source_layer_ids:
            full += (block_size // cfg.compress_ratios[s]) * (cfg.head_dim + cfg.index_head_dim) * el
        return window, full
