"""Fused MoE: grouped expert GEMMs with the clamped SwiGLU in the epilogue.

Token->expert pairs are sorted by expert and each expert's run padded to BLOCK_M rows, so
one program computes one (expert, BLOCK_M rows, BLOCK_N columns) tile with that expert's
weights only. Kernel 1: h = swiglu(x @ w1^T, x @ w3^T) with both accumulators in one pass
over x. Kernel 2: y = (h @ w2^T) * routing weight, then the k rows of a token are summed
(un-permutation). Same signature as kernels.reference.moe_experts.

Stored expert formats (W_FMT): 0 dense, 1 FP8 e4m3 with 128x128 block scales (Base), 2 MXFP4
(V4-Flash): the weight tile is unpacked and scaled in registers (kernels/fused_dequant.py), so
HBM traffic is the stored bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_dequant import fp8_block_tile, mxfp4_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
BLOCK_M = 16  # decode: a few rows per expert
BLOCK_M_LARGE = 64  # prefill: hundreds of rows per expert, so each weight tile serves 4x more rows
LARGE_PAIRS = 4096  # (token, expert) pairs from which the large tiles pay


def _configs():
    """Decode streams expert weights (memory bound): wide K tiles and deep pipelines. Prefill is
    compute bound: wide N tiles, 8 warps. The autotuner picks per (D, I, row class) during
    warm-up, before graph capture."""
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64})]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4),
                                (128, 64, 8, 3), (32, 128, 2, 5), (128, 64, 8, 4), (64, 64, 4, 3))]


def _row_class(pairs: int, experts: int) -> tuple[int, int]:
    """(BLOCK_M, class for the autotune key): 0 a few decode rows, 1 a decode batch, 2 a decode
    batch with dozens of rows per expert, 3 a prefill. Once an expert averages more than 16 rows,
    16-row tiles would stream its weights from HBM several times; 64-row tiles read them once."""
    if pairs >= LARGE_PAIRS:
        return BLOCK_M_LARGE, 3
    if pairs >= 24 * experts:
        return BLOCK_M_LARGE, 2
    return BLOCK_M, int(pairs > 64)


def weight_format(w: torch.Tensor, scale: torch.Tensor | None) -> int:
    if scale is None:
        return 0
    return 2 if w.dtype == torch.int8 else 1


@triton.jit
def _expert_tile(w_ptr, s_ptr, e, n, k, N, K, W_FMT: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of expert e's W^T ([E, N, K] logical) in float32 or the stored float type."""
    if W_FMT == 1:
        t = fp8_block_tile(w_ptr, s_ptr, n, k, N, K, e.to(tl.int64) * N * K, e.to(tl.int64) * tl.cdiv(N, 128) * tl.cdiv(K, 128))
    elif W_FMT == 2:
        t = mxfp4_tile(w_ptr, s_ptr, n, k, N, K, e.to(tl.int64) * N * (K // 2), e.to(tl.int64) * N * (K // 32))
    else:
        t = tl.load(w_ptr + e.to(tl.int64) * N * K + n[None, :] * K + k[:, None],
                    mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
    return t


@triton.autotune(configs=_configs(), key=["D", "I", "ROW_CLASS", "W_FMT"])
@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, sorted_ptr, expert_ptr, n_pairs, D, I, TOPK, limit,
                    ROW_CLASS, W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_pairs
    tok = tl.where(valid, rows // TOPK, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < D
        a = tl.load(x_ptr + tok[:, None] * D + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        b1 = _expert_tile(w1_ptr, s1_ptr, e, n, k, I, D, W_FMT)
        b3 = _expert_tile(w3_ptr, s3_ptr, e, n, k, I, D, W_FMT)
        if DOT_F32:
            a, b1, b3 = a.to(tl.float32), b1.to(tl.float32), b3.to(tl.float32)
        else:
            b1, b3 = b1.to(a.dtype), b3.to(a.dtype)
        acc1 += tl.dot(a, b1)
        acc3 += tl.dot(a, b3)
    gate = tl.minimum(acc1, limit)
    up = tl.minimum(tl.maximum(acc3, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * I + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


@triton.autotune(configs=_configs(), key=["D", "I", "ROW_CLASS", "W_FMT"])
@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, sorted_ptr, expert_ptr, n_pairs, D, I, ROW_CLASS,
                 W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_F32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_pairs
    safe = tl.where(valid, rows, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < I
        a = tl.load(h_ptr + safe[:, None] * I + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        b = _expert_tile(w2_ptr, s2_ptr, e, n, k, D, I, W_FMT)
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc += tl.dot(a, b)
    rw = tl.load(rw_ptr + safe, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * D + n[None, :], acc * rw[:, None], mask=valid[:, None] & nmask[None, :])


def align_by_expert(indices: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Pair ids sorted by expert, each expert's run padded to block_m (padding = n_pairs), and the
    expert of every block (-1: unused). Sizes are upper bounds, so no host sync."""
    flat = indices.reshape(-1)
    n_pairs = flat.numel()
    max_blocks = triton.cdiv(n_pairs, block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    seg_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(n_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_ids = torch.full((max_blocks * block_m,), n_pairs, dtype=torch.long, device=flat.device)
    sorted_ids[seg_start[flat[order]] + rank] = order
    block_start = torch.arange(max_blocks, device=flat.device) * block_m
    expert_of_block = torch.searchsorted(seg_start + padded, block_start, right=True)
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1)
    used = block_start < padded.sum()
    return sorted_ids, torch.where(used, expert_of_block, -1), max_blocks


def moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales=None):
    T, D = x.shape
    E, I = w1.shape[:2]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    fmt = weight_format(w1, s1)
    if fmt == 1:
        s1, s3, s2 = (s.float().contiguous() for s in (s1, s3, s2))
    elif fmt == 2:  # ue8m0 bytes; triton reads them as uint8
        s1, s3, s2 = (s.contiguous().view(torch.uint8) for s in (s1, s3, s2))
    else:
        s1 = s3 = s2 = w1  # unused pointers
    k = indices.shape[1]
    block_m, rows = _row_class(T * k, E)
    sorted_ids, expert_of_block, max_blocks = align_by_expert(indices, E, block_m)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * k, D, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    _gate_up_kernel[lambda m: (max_blocks, triton.cdiv(I, m["BLOCK_N"]))](
        x, w1, w3, s1, s3, h, sorted_ids, expert_of_block, T * k, D, I, k, limit, rows, W_FMT=fmt, BLOCK_M=block_m,
        DOT_F32=_INTERPRET)
    _down_kernel[lambda m: (max_blocks, triton.cdiv(D, m["BLOCK_N"]))](
        h, w2, s2, y, weights.reshape(-1).float().contiguous(), sorted_ids, expert_of_block, T * k, D, I, rows,
        W_FMT=fmt, BLOCK_M=block_m, DOT_F32=_INTERPRET)
    return y.view(T, k, D).sum(dim=1).to(x.dtype)
