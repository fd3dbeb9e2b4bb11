"""Greedy pick in one pass over the logits: argmax, its logprob, and the log-sum-exp.

A decode step's sampler otherwise runs argmax, logsumexp (max, subtract, exp, sum, log) and a
gather as separate passes over [batch, vocab] fp32 logits; at batch 1 each is a single-block
reduction over 129k entries (tens of microseconds apiece). Here every row is split into
chunks: kernel 1 reduces each chunk to (max, first argmax, sum of exp relative to the max),
kernel 2 combines a row's chunks. Same result as kernels.reference.greedy_pick.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048


@triton.jit
def _chunk_kernel(logits_ptr, stride, V, part_m_ptr, part_s_ptr, part_i_ptr, NCHUNK: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    m = -float("inf")
    s = 0.0
    best = 0
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(x == bm, cols, 2147483647), axis=0)  # first index of the block's max
        best = tl.where(bm > m, bi, best)
        m_new = tl.maximum(m, bm)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    tl.store(part_m_ptr + row * NCHUNK + c, m)
    tl.store(part_s_ptr + row * NCHUNK + c, s)
    tl.store(part_i_ptr + row * NCHUNK + c, best)


@triton.jit(do_not_specialize=["n"])
def _combine_kernel(part_m_ptr, part_s_ptr, part_i_ptr, out_ptr, n, NCHUNK: tl.constexpr, NP2: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NP2)
    valid = c < NCHUNK
    m = tl.load(part_m_ptr + row * NCHUNK + c, mask=valid, other=-float("inf"))
    s = tl.load(part_s_ptr + row * NCHUNK + c, mask=valid, other=0.0)
    i = tl.load(part_i_ptr + row * NCHUNK + c, mask=valid, other=2147483647)
    mx = tl.max(m, axis=0)
    token = tl.min(tl.where(m == mx, i, 2147483647), axis=0)  # chunks are in order: first overall
    lse = mx + tl.log(tl.sum(tl.where(valid, s * tl.exp(m - mx), 0.0), axis=0))
    tl.store(out_ptr + row, token.to(tl.float64))
    tl.store(out_ptr + n + row, (mx - lse).to(tl.float64))
    tl.store(out_ptr + 2 * n + row, lse.to(tl.float64))


def greedy_pick_fused(logits: torch.Tensor) -> torch.Tensor:
    n, V = logits.shape
    nchunk = triton.cdiv(V, CHUNK)
    part_m = torch.empty(n, nchunk, dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    part_i = torch.empty(n, nchunk, dtype=torch.int32, device=logits.device)
    out = torch.empty(3, n, dtype=torch.float64, device=logits.device)
    if n == 0:
        return out
    logits = logits.contiguous()
    _chunk_kernel[(n, nchunk)](logits, logits.stride(0), V, part_m, part_s, part_i, NCHUNK=nchunk, CHUNK=CHUNK,
                               BLOCK=1024)
    _combine_kernel[(n,)](part_m, part_s, part_i, out, n, NCHUNK=nchunk, NP2=triton.next_power_of_2(nchunk))
    return out
