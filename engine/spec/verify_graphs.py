"""Speculative decoding's verify forward as CUDA graphs, one per batch-size bucket.

A pure verify step: every scheduled sequence decodes (its last token and up to k drafts: 1..k + 1
rows, its compressors caught up) and every row wants logits. That is a fixed shape per number of
sequences B: B x (k + 1) token rows, at most ceil((k + 1) / m) closed blocks per sequence and
ratio-m compressor. So a bucket's batch is padded the way engine/graphs/mixed.py pads a mixed
step: padding rows belong to a padding sequence whose tables hold the cache's scratch blocks, and
the compressors' plan is padded to that many closed blocks, whose padding entries read row 0 and
write only the scratch block and slot. The batch's tensors are views of one flat buffer: a step is one pinned
host-to-device copy and one replay.

Besides the logits, the graph leaves what the step's rollback needs in static buffers shared by
every bucket: each row's residual streams (the MTP's input) or also DSpark's target features (the
DSpark proposer's input), the blocks each compressor closed
(reopened when a rejected draft closed them) and the CSA overlap state of the batch's slots from
before the step. On the CPU (no graphs) the same padded batch runs eagerly through the same
function: the tests compare it with the unpadded eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.cache import KVCache
from engine.compress_plan import CompressPlan, plan_arrays
from engine.forward_batch import ForwardBatch
from engine.graphs.capture import capture, capture_buckets, replay_bucket
from engine.graphs.static_batch import pack_rows
from engine.sequence import Sequence
from engine.spec.rollback_graphs import RollbackGraphs

# the plan's arrays in CompressPlan's order (src, blk_seq, blk_entry, prev, bnd_blk, bnd_seq,
# bnd_logical, upd_slot, upd_blk, pend_row, pend_dst); their lengths per (T rows, B sequences, ratio m,
# N closed blocks at most)
_PLAN_LENGTHS = lambda T, B, m, N: (N * m, N, N, N, N, N, N, B, B, T, T)


def max_closed_blocks(B: int, k1: int, m: int) -> int:
    """Closed blocks of a ratio-m compressor in a verify of B sequences x k1 rows: k1 consecutive
    positions end at most ceil(k1 / m) blocks."""
    return B * -(-k1 // m)


@dataclass
class VerifyOutput:
    logits: torch.Tensor  # [T, V] every row's logits, in batch order
    hidden: torch.Tensor  # [T, hc_mult, D] every row's residual streams (before the HC head)
    features: torch.Tensor | None  # [T, n_targets * D] DSpark's target features of every row (when kept)
    closed_blocks: dict  # id(state) -> (kv, gate) [>= blocks, m, C]: the rows of the blocks closed, in plan order
    blocks: dict  # ratio -> (batch index, entry) of each closed block, host lists, in plan order
    snapshot: dict  # id(state) -> (prev_kv, prev_gate, has_prev) of batch index b at row b


@dataclass
class _Bucket:
    B: int  # sequences (a padding sequence sits at index B)
    T: int  # token rows
    fields: dict[str, tuple[int, int]]  # name -> (offset, length) in flat
    plans: dict[int, list[tuple[int, int]]]  # ratio -> its plan arrays' (offset, length)
    fb: ForwardBatch  # views of flat; the graph reads them
    flat: torch.Tensor
    staging: torch.Tensor  # pinned on CUDA; a verify step reads back before the next one packs
    pad: np.ndarray  # flat's all-padding contents
    graph: torch.cuda.CUDAGraph | None = None


class VerifyGraphs:
    """The padded verify batches of every bucket, captured as CUDA graphs when `pool` is given."""

    def __init__(self, model, cache: KVCache, max_model_len: int, num_speculative_tokens: int,
                 buckets: list[int], pool=None, capture_fn=capture, features: bool = False):
        """features: the forward also leaves DSpark's target features (DeepseekV4.dspark_features)."""
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.max_model_len, self.k1 = max_model_len, num_speculative_tokens + 1
        self.width = -(-max_model_len // cache.block_size) + 1
        self.ratios = sorted({r for r in model.cfg.compress_ratios if r})
        self.buckets = sorted(set(buckets))
        self.replays = 0  # verify steps run through a padded batch (graph, or eagerly on the CPU)
        cfg, dev, B, T = model.cfg, self.device, max(self.buckets, default=0), max(self.buckets, default=0) * self.k1
        self.states = [st for st in cache.comp_state + cache.index_state if st is not None]
        # shared outputs: every bucket's graph writes here, so no graph keeps outputs of its own in the pool
        self.hidden = torch.zeros(T, cfg.hc_mult, cfg.hidden_size, dtype=model.embed.weight.dtype, device=dev)
        self.logits = torch.zeros(T, cfg.vocab_size, device=dev)
        self.features = (torch.zeros(T, len(cfg.dspark.target_layer_ids) * cfg.hidden_size, dtype=self.hidden.dtype,
                                     device=dev) if features else None)
        self.closed = {id(st): tuple(t.new_zeros(max_closed_blocks(B, self.k1, t.shape[1]), *t.shape[1:])
                                     for t in (st.pend_kv, st.pend_gate)) for st in self.states}
        self.snap = {id(st): (st.prev_kv.new_zeros(B + 1, *st.prev_kv.shape[1:]),
                              st.prev_gate.new_zeros(B + 1, *st.prev_gate.shape[1:]),
                              st.has_prev.new_zeros(B + 1)) for st in self.states if st.prev_kv is not None}
        self.static: dict[int, _Bucket] = capture_buckets(self.buckets, self._bucket, self._forward, pool, capture_fn)
        self.rollback = RollbackGraphs(self, pool, capture_fn)  # after a replay: reopen what rejected drafts closed

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket that holds `batch_size` sequences."""
        return min(b for b in self.buckets if b >= batch_size)

    def fits(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Every sequence decodes its last token plus its drafts, within the largest bucket."""
        return bool(self.buckets) and len(batch) <= self.buckets[-1] and all(
            s.num_computed_tokens == s.num_tokens - 1 and n == 1 + len(s.spec_token_ids) <= self.k1
            and not s.has_pending_token for s, n in batch)

    # --- the padded batch -----------------------------------------------------------------------

    def _bucket(self, B: int) -> _Bucket:
        T, S, c = B * self.k1, B + 1, self.cache
        fields, plans, at = {}, {}, 0
        for name, n in (("input_ids", T), ("positions", T), ("window_slots", T), ("token_seq", T),
                        ("replay_start_t", S), ("state_slot_t", S), ("tables", 2 * S * self.width)):
            fields[name], at = (at, n), at + n
        for m in self.ratios:
            plans[m] = []
            for n in _PLAN_LENGTHS(T, B, m, max_closed_blocks(B, self.k1, m)):
                plans[m].append((at, n))
                at += n
        pad = np.zeros(at, dtype=np.int64)
        bs = c.block_size
        for name, v in (("window_slots", c.scratch_window * bs), ("token_seq", B), ("state_slot_t", c.scratch_slot)):
            o, n = fields[name]
            pad[o:o + n] = v
        o, n = fields["tables"]
        tables = pad[o:o + n].reshape(2, S, self.width)
        tables[0], tables[1] = c.scratch_window, c.scratch_full
        for m, parts in plans.items():  # the padding sequence's scratch blocks and slot, row 0 to read
            for (o, n), v in zip(parts, (0, B, 0, 0, 0, B, 0, c.scratch_slot, 0, 0, c.scratch_slot * m)):
                pad[o:o + n] = v
        flat = torch.from_numpy(pad.copy()).to(self.device)
        v = {name: flat[o:o + n] for name, (o, n) in fields.items()}
        tab = v["tables"].view(2, S, self.width)
        fb = ForwardBatch(
            input_ids=v["input_ids"], positions=v["positions"], seq_lens=[], starts=[], replay_starts=[],
            compress_from=[], window_slots=v["window_slots"], window_tables=tab[0], full_tables=tab[1],
            state_slots=[], logits_rows=torch.arange(T, device=self.device), token_seq=v["token_seq"],
            replay_start_t=v["replay_start_t"], state_slot_t=v["state_slot_t"], is_decode=False,
            max_pos=self.max_model_len - 1,  # the indexer sizes for the longest sequence
            plans={("compress", m): CompressPlan(m, max_closed_blocks(B, self.k1, m), *(flat[o:o + n] for o, n in parts))
                   for m, parts in plans.items()})
        staging = torch.empty(at, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return _Bucket(B, T, fields, plans, fb, flat, staging, pad)

    def pack(self, batch: list[tuple[Sequence, int]], bk: _Bucket, host: np.ndarray) -> tuple[int, dict]:
        """Write the step into `host` in the bucket's flat layout (what build_batch gives for the real
        rows, padding elsewhere). -> (real rows, ratio -> (blk_seq, blk_entry) host lists)."""
        c, bs = self.cache, self.cache.block_size
        host[:] = bk.pad
        col = lambda name: host[bk.fields[name][0]:bk.fields[name][0] + bk.fields[name][1]]
        tables = col("tables").reshape(2, bk.B + 1, self.width)
        ids = [[s.last_token_id, *s.spec_token_ids[:k - 1]] for s, k in batch]
        n, starts, cfrom, slots, row0 = pack_rows(batch, ids, col, tables, bs)
        T = int(n.sum())
        blocks = {}
        for m, parts in bk.plans.items():
            arrays = plan_arrays(n, starts, cfrom, slots, m, bs, c.scratch_slot + 1, bk.T)
            for (o, cap), a in zip(parts, arrays):
                assert len(a) <= cap, "a verify step closes at most ceil((k + 1) / ratio) blocks per sequence"
                host[o:o + len(a)] = a
            if len(arrays[1]):
                blocks[m] = (arrays[1].tolist(), arrays[2].tolist())
        return T, blocks

    def _forward(self, bk: _Bucket) -> None:
        """The step on the bucket's static batch; what it leaves goes to the shared buffers."""
        fb, T, S = bk.fb, bk.T, bk.B + 1
        for st in self.states:  # the overlap state before the step (a reopened block restores it)
            if id(st) in self.snap:
                for dst, src in zip(self.snap[id(st)], (st.prev_kv, st.prev_gate, st.has_prev)):
                    dst[:S].copy_(src[fb.state_slot_t])
        fb.closed_blocks = {}
        if self.features is not None:
            h, f = self.model.dspark_features(fb, self.cache)
            self.features[:T].copy_(f)
        else:
            h = self.model.hidden_states(fb, self.cache)
        self.hidden[:T].copy_(h)
        self.logits[:T].copy_(self.model.compute_logits(h))
        for sid, (kv, gate) in fb.closed_blocks.items():
            dst_kv, dst_gate = self.closed[sid]
            dst_kv[:kv.shape[0]].copy_(kv)
            dst_gate[:gate.shape[0]].copy_(gate)

    def run(self, batch: list[tuple[Sequence, int]]) -> VerifyOutput:
        """Pack, one copy, replay (or run the padded batch eagerly, on the CPU)."""
        bk = self.static[self.bucket(len(batch))]
        self.replays += 1
        T, blocks = self.pack(batch, bk, bk.staging.numpy())
        replay_bucket(bk, self._forward)
        return VerifyOutput(self.logits[:T], self.hidden[:T], None if self.features is None else self.features[:T],
                            self.closed, blocks, self.snap)
