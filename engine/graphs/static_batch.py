"""Padded static batches: a step's ragged metadata packed into fixed-shape views of one flat
buffer, so a step is one pinned host-to-device copy and one graph replay (mixed steps here,
speculative verify in engine/spec/verify_graphs.py, V4.1's split steps)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.cache import KVCache
from engine.compress_plan import CompressPlan
from engine.forward_batch import ForwardBatch
from engine.graphs.staging import StagingPair
from engine.sequence import Sequence


def new_token_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without concatenating the whole history."""
    p = seq.prompt_token_ids
    if start >= len(p):
        return seq.output_token_ids[start - len(p):start - len(p) + n]
    return p[start:start + n] + seq.output_token_ids[:max(0, start + n - len(p))]


def pack_rows(batch: list[tuple[Sequence, int]], token_ids: list[list[int]], col, tables: np.ndarray, bs: int,
              starts: np.ndarray | None = None):
    """The rows every padded static batch packs alike (mixed steps, speculative verify): each
    sequence's block tables over the padding fill, its `token_ids` at the positions after its
    computed tokens (or from `starts`), the window slots they write, its replay start and state
    slot (`col(name)`: that field of the flat host buffer). -> (rows per sequence, starts,
    compress_from, state slots, first row per sequence), numpy."""
    S = len(batch)
    n = np.fromiter((k for _, k in batch), dtype=np.int64, count=S)
    if starts is None:
        starts = np.fromiter((s.num_computed_tokens for s, _ in batch), dtype=np.int64, count=S)
    cfrom = np.fromiter((s.compress_from for s, _ in batch), dtype=np.int64, count=S)
    slots = np.fromiter((s.blocks.state_slot for s, _ in batch), dtype=np.int64, count=S)
    tables[0, :S], tables[1, :S] = -1, 0  # then each row's blocks over the fill
    for i, (s, _) in enumerate(batch):
        wt, ft = s.blocks.window_table, s.blocks.full_table
        tables[0, i, :len(wt)] = wt
        tables[1, i, :len(ft)] = ft
    ids = [t for row in token_ids for t in row]
    T = len(ids)
    row0 = np.cumsum(n) - n
    seq = np.repeat(np.arange(S), n)
    pos = np.arange(T) + np.repeat(starts - row0, n)
    col("input_ids")[:T] = ids
    col("positions")[:T] = pos
    col("token_seq")[:T] = seq
    col("window_slots")[:T] = tables[0, seq, pos // bs] * bs + pos % bs
    col("replay_start_t")[:S] = [s.replay_start for s, _ in batch]
    col("state_slot_t")[:S] = slots
    return n, starts, cfrom, slots, row0


@dataclass
class StepLayout:
    """Where each field sits in a size's flat buffer: (offset, length)."""

    T: int  # tokens
    S: int  # sequence rows: the real ones, then padding (row S - 1 at least is padding)
    width: int  # block-table columns
    fields: dict[str, tuple[int, int]]
    plans: dict[int, list[tuple[int, int]]]  # ratio -> its plan's parts
    caps: dict[int, int]  # ratio -> closed blocks the plan holds
    size: int


def step_layout(T: int, max_num_seqs: int, width: int, ratios: list[int], extra=None) -> StepLayout:
    """extra(T, S): the model's own fields, (name, length) (V4.1: engine/models/deepseek_v41/mixed_rows.py)."""
    S = min(T, max_num_seqs) + 1
    L = S - 1  # logits rows: one per sampling sequence at most
    fields, at = {}, 0
    for name, n in (("input_ids", T), ("positions", T), ("window_slots", T), ("token_seq", T),
                    ("replay_start_t", S), ("state_slot_t", S), ("logits_rows", L), ("tables", 2 * S * width),
                    *(extra(T, S) if extra else ())):
        fields[name] = (at, n)
        at += n
    plans, caps = {}, {}
    for m in ratios:
        # a closed block ends on a row of this step (so <= T) and at most one per sequence is not whole
        nb = min(T, T // m + L)
        caps[m] = nb
        plans[m] = []
        for n in (nb * m, nb, nb, nb, nb, nb, nb, L, L, T, T):
            plans[m].append((at, n))
            at += n
    return StepLayout(T, S, width, fields, plans, caps, at)


@dataclass
class StaticBatch:
    layout: StepLayout
    fb: ForwardBatch  # its tensors are views of `flat`; the graph reads them
    flat: torch.Tensor
    stagings: StagingPair  # two host buffers, used by alternate steps (see MixedStepGraphs.run)
    pad: np.ndarray  # the all-padding contents of flat
    views: dict[str, torch.Tensor]  # every field of flat by name
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


def _pad_values(lay: StepLayout, cache: KVCache, extra) -> np.ndarray:
    c, bs = cache, cache.block_size
    host = np.zeros(lay.size, dtype=np.int64)
    f = lay.fields
    for name, v in (("window_slots", c.scratch_window * bs), ("token_seq", lay.S - 1),
                    ("state_slot_t", c.scratch_slot)):
        o, n = f[name]
        host[o:o + n] = v
    o, n = f["tables"]
    tables = host[o:o + n].reshape(2, lay.S, lay.width)
    tables[0], tables[1] = c.scratch_window, c.scratch_full
    for m, parts in lay.plans.items():
        # src, blk_seq, blk_entry, prev, bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst:
        # the padding sequence's (scratch) blocks, the scratch slot, row 0 to read
        vals = (0, lay.S - 1, 0, 0, 0, lay.S - 1, 0, c.scratch_slot, 0, 0, c.scratch_slot * m)
        for (o, n), v in zip(parts, vals):
            host[o:o + n] = v
    if extra is not None:
        extra.pad(lambda name: host[f[name][0]:f[name][0] + f[name][1]], lay.S)
    return host


def padded_batch(lay: StepLayout, cache: KVCache, device: torch.device, max_model_len: int, extra=None) -> StaticBatch:
    """The static batch of `lay`, all padding: its ForwardBatch's tensors are views of one flat
    device buffer. extra: the model's fields (`pad`, `attach`; V4.1: engine/models/deepseek_v41/mixed_rows.py)."""
    pad = _pad_values(lay, cache, extra)
    flat = torch.from_numpy(pad.copy()).to(device)
    v = {name: flat[o:o + n] for name, (o, n) in lay.fields.items()}
    tables = v["tables"].view(2, lay.S, lay.width)
    plans = {}
    for m, parts in lay.plans.items():
        plans[("compress", m)] = CompressPlan(m, lay.caps[m], *(flat[o:o + n] for o, n in parts))
    fb = ForwardBatch(
        input_ids=v["input_ids"], positions=v["positions"], seq_lens=[], starts=[], replay_starts=[],
        compress_from=[], window_slots=v["window_slots"], window_tables=tables[0], full_tables=tables[1],
        state_slots=[], logits_rows=v["logits_rows"], token_seq=v["token_seq"],
        replay_start_t=v["replay_start_t"], state_slot_t=v["state_slot_t"],
        is_decode=False, max_pos=max_model_len - 1,  # the indexer sizes for the longest sequence
        plans=plans)
    if extra is not None:
        extra.attach(fb, lambda name: v[name], lay.T)
    return StaticBatch(lay, fb, flat, StagingPair(lay.size, device.type == "cuda"), pad, v)


def host_fields(st: StaticBatch, host: np.ndarray):
    """col(name): that field of `host` (a flat buffer in st's layout)."""
    f = st.layout.fields
    return lambda name: host[f[name][0]:f[name][0] + f[name][1]]
