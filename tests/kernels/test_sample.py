"""Fused greedy pick vs the reference: argmax (first index on ties), its logprob, log-sum-exp,
over a vocabulary that is not a multiple of the chunk, with masked (-inf) entries and ties."""

import torch

from kernels import reference as ref
from kernels.fused_sample import CHUNK, greedy_pick_fused


def test_greedy_pick_matches_reference():
    g = torch.Generator().manual_seed(0)
    V = 2 * CHUNK + 777
    logits = torch.randn(5, V, generator=g) * 4
    logits[1, :100] = float("-inf")  # masked ids (EOS before min_tokens)
    logits[2, 10] = logits[2, CHUNK + 5] = logits[2].max() + 1  # a tie across chunks: the first wins
    logits[3, V - 1] = 50.0  # the max in the ragged last chunk
    logits[4, CHUNK: 2 * CHUNK] = float("-inf")  # a whole chunk masked
    got, want = greedy_pick_fused(logits), ref.greedy_pick(logits)
    assert got[0].tolist() == want[0].tolist() == logits.argmax(-1).double().tolist()
    assert torch.allclose(got[1:], want[1:], atol=1e-5, rtol=1e-6)
