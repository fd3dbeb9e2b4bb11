"""The MTP's catch-up and chained drafts of a pure verify step as one CUDA graph per verify bucket.

After a verify step that replayed a verify graph (engine/spec/verify_graphs.py), every sequence's MTP
work has a fixed shape too:

- the catch-up runs over all of a sequence's verify rows, on the verify bucket's own positions,
  window slots and tables, fed the verify's residual streams (its shared buffer) and the tokens
  the step emitted. Rows past a sequence's last accepted one get stand-in tokens: they write MTP
  window KV at positions after the last accepted one, which the chained steps (or the next step's
  catch-up) write again before any query reads them (a query reads positions at or below its own);
- draft 1 is the argmax at each sequence's last accepted row, then k - 1 one-row steps whose
  tokens are the previous argmax, on the device; a sequence that wants fewer drafts has padding
  rows there (the padding sequence: scratch window block, position 0).

The host decides what the eager path decides (which sequences draft, how many, their blocks) and
packs it; one replay, then the host does the step's scheduler and output work while it runs, then
one read-back of the [B, k] drafts. On the CPU the same function runs eagerly on the static
buffers (the tests compare it with the eager MTP path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.graphs.capture import capture, capture_buckets, replay_bucket
from engine.spec.verify_graphs import VerifyGraphs


@dataclass
class _Bucket:
    B: int
    T: int
    fields: dict[str, tuple[int, int]]  # name -> (offset, length) in flat
    catch_up: ForwardBatch  # the verify bucket's rows, the emitted tokens as inputs
    chained: list[ForwardBatch]  # one row per sequence, k - 1 of them
    flat: torch.Tensor
    staging: torch.Tensor
    pad: np.ndarray
    graph: torch.cuda.CUDAGraph | None = None


class DraftGraphs:
    def __init__(self, mtp, model, mtp_cache, verify: VerifyGraphs, pool=None, capture_fn=capture):
        self.mtp, self.model, self.cache, self.verify = mtp, model, mtp_cache, verify
        self.k = verify.k1 - 1
        self.replays = 0
        B = max(verify.buckets, default=0)
        self.drafts = torch.zeros(B, self.k, dtype=torch.long, device=verify.device)  # shared by every bucket
        self.static: dict[int, _Bucket] = capture_buckets(verify.buckets, self._bucket, self._forward, pool, capture_fn)

    def _bucket(self, B: int) -> _Bucket:
        vb, c, width = self.verify.static[B], self.verify.cache, self.verify.width
        T, S, bs = vb.T, B + 1, c.block_size
        names = [("catch_up_ids", T), ("gather", B), ("tables", S * width)]
        for s in range(1, self.k):
            names += [(f"ids{s}", B), (f"pos{s}", B), (f"slots{s}", B), (f"seq{s}", B)]
        fields, at = {}, 0
        for name, n in names:
            fields[name], at = (at, n), at + n
        pad = np.zeros(at, dtype=np.int64)
        for name, (o, n) in fields.items():  # ids, positions, gather rows 0; the padding sequence's scratch block
            if name == "tables":
                pad[o:o + n] = c.scratch_window
            elif name.startswith("slots"):
                pad[o:o + n] = c.scratch_window * bs
            elif name.startswith("seq"):
                pad[o:o + n] = B
        flat = torch.from_numpy(pad.copy()).to(self.verify.device)
        v = {name: flat[o:o + n] for name, (o, n) in fields.items()}
        f = vb.fb
        common = dict(seq_lens=[], starts=[], replay_starts=[], compress_from=[], full_tables=f.full_tables,
                      state_slots=[], replay_start_t=f.replay_start_t, state_slot_t=f.state_slot_t, is_decode=False,
                      max_pos=self.verify.max_model_len - 1)
        # the catch-up reads the tables the verify read (a draft's block allocation may add to them since)
        catch_up = ForwardBatch(input_ids=v["catch_up_ids"], positions=f.positions, window_slots=f.window_slots,
                                window_tables=f.window_tables, logits_rows=f.logits_rows, token_seq=f.token_seq,
                                **common)
        tables = v["tables"].view(S, width)
        chained = [ForwardBatch(input_ids=v[f"ids{s}"], positions=v[f"pos{s}"], window_slots=v[f"slots{s}"],
                                window_tables=tables, logits_rows=v["gather"], token_seq=v[f"seq{s}"], **common)
                   for s in range(1, self.k)]
        staging = torch.empty(at, dtype=torch.long, pin_memory=self.verify.device.type == "cuda")
        return _Bucket(B, T, fields, catch_up, chained, flat, staging, pad)

    def _forward(self, bk: _Bucket) -> None:
        h = self.mtp(self.model, bk.catch_up, self.cache, self.verify.hidden[:bk.T])
        x = h[self._gather(bk)]
        d = self.mtp.compute_logits(self.model, x).argmax(-1)
        self.drafts[:bk.B, 0].copy_(d)
        for s, fb in enumerate(bk.chained, start=1):
            fb.input_ids.copy_(d)
            x = self.mtp(self.model, fb, self.cache, x)
            d = self.mtp.compute_logits(self.model, x).argmax(-1)
            self.drafts[:bk.B, s].copy_(d)

    def _gather(self, bk: _Bucket) -> torch.Tensor:
        o, n = bk.fields["gather"]
        return bk.flat[o:o + n]

    def pack(self, batch, items: dict[int, tuple[int, list[int]]], drafting: dict[int, tuple[int, int]],
             bk: _Bucket, host: np.ndarray) -> None:
        """items: batch index -> (its first verify row, the catch-up's input tokens); drafting: batch
        index -> (position of its first chained row, drafts wanted)."""
        bs, width = self.verify.cache.block_size, self.verify.width
        host[:] = bk.pad
        col = lambda name: host[bk.fields[name][0]:bk.fields[name][0] + bk.fields[name][1]]
        ids, gather = col("catch_up_ids"), col("gather")
        tables = col("tables").reshape(bk.B + 1, width)
        for b, (row0, toks) in items.items():
            ids[row0:row0 + len(toks)] = toks
            gather[b] = row0 + len(toks) - 1
        for b, (base, k) in drafting.items():
            wt = batch[b][0].blocks.window_table
            tables[b, :len(wt)] = wt
            tables[b, len(wt):] = -1
            for s in range(1, k):
                p = base + s - 1
                col(f"pos{s}")[b], col(f"slots{s}")[b], col(f"seq{s}")[b] = p, wt[p // bs] * bs + p % bs, b

    def launch(self, batch, items, drafting) -> None:
        """Pack, one copy, replay (or run the static batch eagerly, on the CPU); read() waits for it."""
        bk = self.static[self.verify.bucket(len(batch))]
        self.replays += 1
        self.pack(batch, items, drafting, bk, bk.staging.numpy())
        replay_bucket(bk, self._forward)

    def read(self, batch_size: int) -> list[list[int]]:
        """-> each batch row's k drafts (the host keeps the ones it wanted)."""
        return self.drafts[:batch_size].tolist()
