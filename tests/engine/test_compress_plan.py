"""The compressors' step plan (engine/compress_plan.py), built in numpy for every sequence at
once, equals the plain per-sequence, per-block loop it replaced (kept here as the reference),
on random mixed steps: decodes, prefill chunks starting mid-block, replayed tokens below
compress_from, sequences that absorb nothing."""

import numpy as np
import pytest

from engine.compress_plan import plan_arrays


def loop_plan(seq_lens, starts, compress_from, state_slots, m, bs, num_slots, T):
    src, blk_seq, blk_entry, prev = [], [], [], []
    bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst = [], [], [], [], [], [], []
    row0 = 0
    for s, n in enumerate(seq_lens):
        start, cfrom, slot = starts[s], max(compress_from[s], starts[s]), state_slots[s]
        end = start + n
        if cfrom < end:
            first_closed, last_closed = cfrom // m, end // m
            for b in range(first_closed, last_closed):
                j = len(blk_seq)
                for q in range(b * m, (b + 1) * m):
                    src.append(row0 + q - start if q >= cfrom else T + slot * m + q % m)
                blk_seq.append(s)
                blk_entry.append(b)
                prev.append(slot if b == first_closed else num_slots + j - 1)
                if ((b + 1) * m) % bs == 0:
                    bnd_blk.append(j)
                    bnd_seq.append(s)
                    bnd_logical.append((b + 1) * m // bs - 1)
            if last_closed > first_closed:
                upd_slot.append(slot)
                upd_blk.append(len(blk_seq) - 1)
            for q in range(max(cfrom, last_closed * m), end):
                pend_row.append(row0 + q - start)
                pend_dst.append(slot * m + q % m)
        row0 += n
    return [src, blk_seq, blk_entry, prev, bnd_blk, bnd_seq, bnd_logical, upd_slot, upd_blk, pend_row, pend_dst]


@pytest.mark.parametrize("m", [4, 16, 128])
def test_numpy_plan_equals_the_per_sequence_loop(m):
    rng = np.random.default_rng(m)
    bs = max(m, 16) * 2
    for trial in range(60):
        S = int(rng.integers(1, 12))
        decode = rng.random(S) < 0.5
        n = np.where(decode, 1, rng.integers(1, 3 * m + 5, S))
        starts = rng.integers(0, 6 * m, S)
        # bounded replay: compress_from above start (up to past the chunk's end: absorbs nothing)
        cfrom = np.where(rng.random(S) < 0.3, starts + rng.integers(0, 2 * m + 2, S), starts)
        slots = rng.permutation(40)[:S]
        T = int(n.sum()) + int(rng.integers(0, 5))  # padded rows after the real ones
        got = plan_arrays(n, starts, cfrom, slots, m, bs, 41, T)
        want = loop_plan(n.tolist(), starts.tolist(), cfrom.tolist(), slots.tolist(), m, bs, 41, T)
        for g, w in zip(got, want, strict=True):
            assert g.tolist() == w, trial
