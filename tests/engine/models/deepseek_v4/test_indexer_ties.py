"""A sequence's greedy tokens do not depend on the batch it decodes in when the CSA indexer's top-k
meets an exact score tie (kernels.reference.topk_by_score_then_index): the tiny preset, float64."""

import torch

import kernels
from engine.llm import LLM
from engine.request import SamplingParams
from kernels import reference

# On the tiny preset (seed 7), decoding position 76 after this prompt, CSA layer 3 scores entries
# 10, 11 and 18 exactly 0.0 (the indexer's relu) for the 4th of index_topk 4. Batched with a longer
# sequence, the row is padded to that sequence's entries; torch.topk's tie order changed with the
# row's length and the second token flipped (3034 alone, 3986 batched).
TIED_PROMPT = [501, 1009, 3615, 3161, 1827, 3310, 726, 406, 252, 1529, 692, 3247, 3998, 2740, 2606, 1985, 83,
               3907, 662, 2431, 1400, 2536, 338, 3595, 2017, 2233, 3331, 2236, 2884, 2703, 1507, 3171, 798, 3682,
               2354, 2992, 1198, 3106, 990, 1083, 1038, 4092, 1711, 3050, 1737, 1085, 2535, 661, 1830, 1743, 338,
               1686, 2527, 3514, 3140, 194, 2124, 3978, 1556, 3473, 1141, 380, 3337, 1895, 3349, 2460, 2707,
               2692, 202, 3367, 2218, 337, 3325, 92, 1935, 3275]


def _count_boundary_ties(monkeypatch) -> list[int]:
    """Wraps the op to count decode rows whose k-th and (k+1)-th best visible scores are equal, so the
    test proves it reached a tie rather than passing by missing one."""
    ties, op = [0], kernels.indexer_topk

    def counted(iq, iw, pool, tables, positions, token_seq, ratio, topk, max_pos=None, one_per_seq=False,
                iw_scale=1.0):
        if one_per_seq and (max_pos + 1) // ratio > topk:
            scores = reference.indexer_scores_paged(iq, iw, pool, tables, positions, token_seq, ratio,
                                                    (max_pos + 1) // ratio, iw_scale)
            best = scores.sort(dim=-1, descending=True).values
            ties[0] += int((torch.isfinite(best[:, topk]) & (best[:, topk - 1] == best[:, topk])).sum())
        return op(iq, iw, pool, tables, positions, token_seq, ratio, topk, max_pos, one_per_seq, iw_scale)

    monkeypatch.setattr(kernels, "indexer_topk", counted)
    return ties


def test_greedy_tokens_alone_equal_batched_across_an_exact_tie(tiny_dir, monkeypatch):
    longer = torch.randint(5, 4096, (108,), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_dir), dtype="float64", max_model_len=256)
    ties = _count_boundary_ties(monkeypatch)  # after the engine binds the ops
    alone = llm.generate([TIED_PROMPT], [sp])[0].token_ids
    batched = llm.generate([TIED_PROMPT, longer], [sp, sp])[0].token_ids
    assert ties[0] > 0, "the case no longer reaches an exact tie at the top-k boundary: rebuild TIED_PROMPT"
    assert batched == alone
