"""The split-K epilogue shared by the FP8 GEMV and the MoE (kernels/semaphores.py): whichever split
arrives last, the tile's sum is the same bits, so equal inputs give equal outputs run to run (and a
CUDA graph replay equals the eager step it was captured from). The old epilogue started from the
last split's own partial, so its rounding depended on the arrival order."""


import torch
import triton
import triton.language as tl

from kernels.semaphores import split_k_total


@triton.jit
def _total_as_if_last(ws_ptr, out_ptr, last, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.arange(0, BLOCK)
    mask = off < N
    own = tl.load(ws_ptr + last * N + off, mask=mask, other=0.0)
    tl.store(out_ptr + off, split_k_total(ws_ptr, off, mask, own, last, N, SPLITS), mask=mask)


def test_the_sum_does_not_depend_on_which_split_is_last():
    splits, n = 4, 8
    # partials whose float32 sum rounds differently in different orders (1e8 + 1 - 1e8 ...)
    ws = torch.tensor([[1e8] * n, [1.0] * n, [-1e8] * n, [0.5] * n], dtype=torch.float32)
    outs = []
    for last in range(splits):
        out = torch.empty(n, dtype=torch.float32)
        _total_as_if_last[(1,)](ws, out, last, n, SPLITS=splits, BLOCK=8)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert outs[0][0].item() == 0.5  # split order in float32: 1e8 + 1 rounds to 1e8, then - 1e8 + 0.5
    own_first = [ws[last] + sum(ws[s] for s in range(splits) if s != last) for last in range(splits)]
    assert len({o[0].item() for o in own_first}) > 1, "the old order's sums differ: the test can tell them apart"
