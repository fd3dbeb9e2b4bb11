"""Fused MoE: expert GEMMs reading only the routed experts' stored bytes, the clamped SwiGLU in
the epilogue. Kernel 1: h = swiglu(x @ w1^T, x @ w3^T), both accumulators in one pass over x;
kernel 2: y = (h @ w2^T) * routing weight per (token, expert) pair; kernel 3 sums a token's k
rows. Same signature as kernels.reference.moe_experts.

Decode (pairs <= quant_configs.MOE_DECODE_MAX_PAIRS): no sort. The grid is (N tiles, pairs);
the program of a pair that is its expert's first occurrence gathers all pairs of that expert
(a scan of the few hundred routing ids) and streams the expert's [BLOCK_N, K] weight rows once
for all of them, swap-AB (weight rows on the MMA's M side); other programs return at once. So
the bytes read are the experts hit, and every SM streams (6 experts x I / BLOCK_N programs at
one token). Prefill: pairs sorted by expert and padded to BLOCK_M-row tiles (align_by_expert),
one program per (expert tile, N tile).

Stored expert formats (W_FMT): 0 dense, 1 FP8 e4m3 with 128x128 block scales (Base), 2 MXFP4
(V4-Flash), decoded in registers (kernels/fused_dequant.py), or on the GPU with bf16 activations
(config "MX": "scaled") handed packed to tl.dot_scaled. Tiles: kernels/quant_configs.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import quant_configs
from kernels.fused_dequant import fp8_rows_tile, mxfp4_rows_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
MX_SCALED_OK = not _INTERPRET  # tl.dot_scaled for MXFP4 (tests set it to run the interpreter's dot_scaled)
BLOCK_M = 16  # prefill with few rows per expert
BLOCK_M_LARGE = 64  # prefill: hundreds of rows per expert, so each weight tile serves 4x more rows
LARGE_PAIRS = 4096  # (token, expert) pairs from which the large tiles pay


def _row_class(pairs: int, experts: int) -> tuple[int, int]:
    """(BLOCK_M, class) of the sorted path: once an expert averages more than 16 rows, 16-row tiles
    would stream its weights from HBM several times; 64-row tiles read them once."""
    if pairs >= LARGE_PAIRS:
        return BLOCK_M_LARGE, 3
    if pairs >= 24 * experts:
        return BLOCK_M_LARGE, 2
    return BLOCK_M, int(pairs > 64)


def weight_format(w: torch.Tensor, scale: torch.Tensor | None) -> int:
    if scale is None:
        return 0
    return 2 if w.dtype == torch.int8 else 1


FORMAT_NAMES = ("dense", "fp8", "mxfp4")


@triton.jit
def _expert_tile(w_ptr, s_ptr, e, n, k0, N, K, W_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert e's [BLOCK_N, BLOCK_K] weight rows ([E, N, K] logical) and, for FP8, each row's
    block scale for this step (the caller scales the partial product; 1 otherwise)."""
    e64 = e.to(tl.int64)
    if W_FMT == 1:
        t, sw = fp8_rows_tile(w_ptr + e64 * N * K, s_ptr + e64 * tl.cdiv(N, 128) * tl.cdiv(K, 128), n, k0, N, K, BLOCK_K)
    elif W_FMT == 2:
        t = mxfp4_rows_tile(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32), n, k0, N, K, BLOCK_N, BLOCK_K)
        sw = tl.full((BLOCK_N,), 1.0, tl.float32)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        t = tl.load(w_ptr + e64 * N * K + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        sw = tl.full((BLOCK_N,), 1.0, tl.float32)
    return t, sw


@triton.jit
def _dot_wt(w, sw, xt, W_FMT: tl.constexpr, DOT_F32: tl.constexpr):
    """w [BN, BK] (any stored float type; FP8 rows scaled by sw) @ xt [BK, BM], float32 result. On
    the tensor cores the FP8 scale multiplies the partial product; in float32 (the interpreter)
    the tile, as the float32 reference dequantizes."""
    if DOT_F32:
        if W_FMT == 1:
            return tl.dot(w.to(tl.float32) * sw[:, None], xt.to(tl.float32), input_precision="ieee")
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    if W_FMT == 1:
        return tl.dot(w.to(xt.dtype), xt) * sw[:, None]
    return tl.dot(w.to(xt.dtype), xt)


@triton.jit
def _expert_dot(w_ptr, s_ptr, e, n, k0, N, K, xt, W_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    """Expert e's rows n over K step k0 @ xt [BLOCK_K, BM], float32. MX_SCALED (MXFP4, bf16 xt, GPU):
    the packed e2m1 bytes and ue8m0 bytes go to tl.dot_scaled as stored, which unpacks them to bf16
    with byte permutes and integer ops (no conversion-unit instructions, which bound the e4m3
    placement at ~0.8 TB/s) and applies each 32-wide group's scale; loads stay 16-byte row-major."""
    if MX_SCALED:
        e64 = e.to(tl.int64)
        KH = tl.multiple_of(K // 2, 16)  # K % 32 == 0 (the scale groups): rows 16-byte aligned, so 16-byte loads
        kb = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), 16), 16)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        nmask = n < N
        w = tl.load(w_ptr + e64 * N * KH + n[:, None] * KH + kb[None, :],
                    mask=nmask[:, None] & (kb[None, :] < KH), other=0).to(tl.uint8, bitcast=True)
        sc = tl.load(s_ptr + e64 * N * (K // 32) + n[:, None] * (K // 32) + ks[None, :],
                     mask=nmask[:, None] & (ks[None, :] < K // 32), other=0)
        return tl.dot_scaled(w, sc, "e2m1", xt, None, "bf16")
    t, sw = _expert_tile(w_ptr, s_ptr, e, n, k0, N, K, W_FMT, BLOCK_N, BLOCK_K)
    return _dot_wt(t, sw, xt, W_FMT, DOT_F32)


@triton.jit
def _expert_rows(idx_ptr, p, n_pairs, NP: tl.constexpr):
    """The pairs routed to pair p's expert: (expert, match mask [NP], rank of each match, count, first such pair)."""
    pairs = tl.arange(0, NP)
    ids = tl.load(idx_ptr + pairs, mask=pairs < n_pairs, other=-1)
    e = tl.load(idx_ptr + p)
    match = ids == e
    hits = match.to(tl.int32)
    first = tl.min(tl.where(match, pairs, NP), axis=0)
    return e, match, tl.cumsum(hits, 0) - 1, tl.sum(hits, axis=0), first


@triton.jit
def _rows_block(match, rank, r0, cnt, NP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pair ids of ranks r0..r0+BLOCK_M among the matches (0 past the count) and their validity."""
    r = r0 + tl.arange(0, BLOCK_M)
    sel = match[None, :] & (rank[None, :] == r[:, None])
    rows = tl.sum(tl.where(sel, tl.arange(0, NP)[None, :], 0), axis=1)
    return rows, r < cnt


@triton.jit
def _clamped_swiglu(gate, up, limit):
    """DeepSeek-V4's SwiGLU: the gate clamped above at `limit`, the up projection to +-limit."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gate_up_tile(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, rows, tok, valid, e, n, D, I, limit,
                  W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    """h[rows, n] = SwiGLU(x[tok] @ w1[e].T, x[tok] @ w3[e].T) for one tile (decode and prefill alike)."""
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + tok[None, :] * D + k[:, None], mask=valid[None, :] & (k[:, None] < D), other=0.0)
        acc1 += _expert_dot(w1_ptr, s1_ptr, e, n, k0, I, D, xt, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)
        acc3 += _expert_dot(w3_ptr, s3_ptr, e, n, k0, I, D, xt, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)
    h = _clamped_swiglu(acc1, acc3, limit)
    tl.store(h_ptr + rows[None, :] * I + n[:, None], h.to(h_ptr.dtype.element_ty), mask=valid[None, :] & (n[:, None] < I))


@triton.jit
def _down_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, rows, load_rows, valid, e, n, D, I,
               W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    """y[rows, n] = routing weight * (h[rows] @ w2[e].T) for one tile; `load_rows`: rows safe to address."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_ptr + load_rows[None, :] * I + k[:, None], mask=valid[None, :] & (k[:, None] < I), other=0.0)
        acc += _expert_dot(w2_ptr, s2_ptr, e, n, k0, D, I, ht, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)
    rw = tl.load(rw_ptr + load_rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[None, :] * D + n[:, None], acc * rw[None, :], mask=valid[None, :] & (n[:, None] < D))


@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_decode_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, idx_ptr, n_pairs, D, I, TOPK, limit,
                           W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           NP: tl.constexpr, DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    pid_n, p = tl.program_id(0), tl.program_id(1)
    e, match, rank, cnt, first = _expert_rows(idx_ptr, p, n_pairs, NP)
    if (first != p) | (e < 0):  # another program serves this expert, or another rank (-1)
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    for r0 in range(0, cnt, BLOCK_M):  # one pass unless an expert has more than BLOCK_M rows
        rows, valid = _rows_block(match, rank, r0, cnt, NP, BLOCK_M)
        _gate_up_tile(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, rows, rows // TOPK, valid, e, n, D, I, limit,
                      W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)


@triton.jit(do_not_specialize=["n_pairs"])
def _down_decode_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, idx_ptr, n_pairs, D, I, W_FMT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NP: tl.constexpr,
                        DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    pid_n, p = tl.program_id(0), tl.program_id(1)
    e, match, rank, cnt, first = _expert_rows(idx_ptr, p, n_pairs, NP)
    if (first != p) | (e < 0):  # another program serves this expert, or another rank (-1)
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    for r0 in range(0, cnt, BLOCK_M):
        rows, valid = _rows_block(match, rank, r0, cnt, NP, BLOCK_M)
        _down_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, rows, rows, valid, e, n, D, I,
                   W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)


@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, sorted_ptr, expert_ptr, n_pairs, D, I, TOPK, limit,
                    W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_F32: tl.constexpr, MX_SCALED: tl.constexpr):
    """Prefill: one (expert tile of BLOCK_M sorted pairs, N tile); acc^T kept [BLOCK_N, BLOCK_M] as in decode."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _gate_up_tile(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, rows, tl.where(valid, rows // TOPK, 0), valid, e, n, D, I,
                  limit, W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, sorted_ptr, expert_ptr, n_pairs, D, I, W_FMT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 MX_SCALED: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _down_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, rows, tl.where(valid, rows, 0), valid, e, n, D, I,
               W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX_SCALED)


@triton.jit(do_not_specialize=["T"])
def _sum_topk_kernel(y_ptr, idx_ptr, out_ptr, T, D, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(TOPK):  # fixed order: the result does not depend on which program ran first
        e = tl.load(idx_ptr + t * TOPK + j)  # -1: another rank's expert, its row never written
        acc += tl.load(y_ptr + (t * TOPK + j) * D + d, mask=mask & (d * 0 + e >= 0), other=0.0)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def align_by_expert(indices: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Pair ids sorted by expert, each expert's run padded to block_m (padding = n_pairs), and the
    expert of every block (-1: unused). Sizes are upper bounds, so no host sync. Pairs of expert
    -1 (another rank's) go to one extra segment past the last expert whose blocks are unused."""
    flat = indices.reshape(-1)
    flat = torch.where(flat < 0, num_experts, flat)
    n_pairs = flat.numel()
    max_blocks = triton.cdiv(n_pairs, block_m) + num_experts + 1
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
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
    used = block_start < padded[:num_experts].sum()
    return sorted_ids, torch.where(used, expert_of_block, -1), max_blocks


def _opts(cfg: dict) -> dict:
    return {} if _INTERPRET else {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}


def _tiles(cfg: dict, fmt: int, act_dtype: torch.dtype) -> dict:
    cfg = {**cfg, **(quant_configs.INTERPRET_MOE if _INTERPRET else {})}
    if fmt == 1 and 128 % cfg["BLOCK_K"] or fmt == 2 and cfg["BLOCK_K"] % 32:
        raise ValueError(f"MoE BLOCK_K {cfg['BLOCK_K']} does not fit the {FORMAT_NAMES[fmt]} scale blocks")
    if cfg.get("MX", "e4m3") not in ("scaled", "e4m3"):
        raise ValueError(f"MoE MX must be 'scaled' or 'e4m3', got {cfg['MX']!r}")
    # dot_scaled's unpack needs bf16 activations and the GPU (the interpreter's float32 path checks the math)
    scaled = fmt == 2 and cfg.get("MX") == "scaled" and act_dtype == torch.bfloat16 and MX_SCALED_OK
    return {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "MX_SCALED": scaled, **_opts(cfg)}


def moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales=None, config: dict | None = None):
    """`config` ({"gate_up": cfg, "down": cfg}, tools/bench_quant.py's sweep) overrides
    kernels/quant_configs.py's entry."""
    T, D = x.shape
    E, I = w1.shape[:2]
    k = indices.shape[1]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    fmt = weight_format(w1, s1)
    if fmt == 1:
        s1, s3, s2 = (s if s.dtype == torch.float32 and s.is_contiguous() else s.float().contiguous() for s in (s1, s3, s2))
    elif fmt == 2:  # ue8m0 bytes; triton reads them as uint8
        s1, s3, s2 = (s.contiguous().view(torch.uint8) for s in (s1, s3, s2))
    else:
        s1 = s3 = s2 = w1  # unused pointers
    n_pairs = T * k
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if n_pairs == 0:
        return out
    cfg = config or quant_configs.moe_config(n_pairs, FORMAT_NAMES[fmt])
    gu, dn = _tiles(cfg["gate_up"], fmt, x.dtype), _tiles(cfg["down"], fmt, x.dtype)
    x = x if x.is_contiguous() else x.contiguous()
    idx = indices.reshape(-1)
    idx = idx if idx.is_contiguous() else idx.contiguous()
    rw = weights.reshape(-1)
    rw = rw if rw.is_contiguous() else rw.contiguous()
    h = torch.empty(n_pairs, I, dtype=x.dtype, device=x.device)
    y = torch.empty(n_pairs, D, dtype=torch.float32, device=x.device)
    if n_pairs <= quant_configs.MOE_DECODE_MAX_PAIRS:
        bm, NP = cfg["gate_up"].get("BLOCK_M", 16), triton.next_power_of_2(n_pairs)
        _gate_up_decode_kernel[(triton.cdiv(I, gu["BLOCK_N"]), n_pairs)](
            x, w1, w3, s1, s3, h, idx, n_pairs, D, I, k, limit, W_FMT=fmt, BLOCK_M=bm, NP=NP, DOT_F32=_INTERPRET, **gu)
        bm = cfg["down"].get("BLOCK_M", 16)
        _down_decode_kernel[(triton.cdiv(D, dn["BLOCK_N"]), n_pairs)](
            h, w2, s2, y, rw, idx, n_pairs, D, I, W_FMT=fmt, BLOCK_M=bm, NP=NP, DOT_F32=_INTERPRET, **dn)
    else:
        bm = cfg["gate_up"].get("BLOCK_M") or _row_class(n_pairs, E)[0]
        sorted_ids, expert_of_block, max_blocks = align_by_expert(indices, E, bm)
        _gate_up_kernel[(max_blocks, triton.cdiv(I, gu["BLOCK_N"]))](
            x, w1, w3, s1, s3, h, sorted_ids, expert_of_block, n_pairs, D, I, k, limit, W_FMT=fmt, BLOCK_M=bm,
            DOT_F32=_INTERPRET, **gu)
        _down_kernel[(max_blocks, triton.cdiv(D, dn["BLOCK_N"]))](
            h, w2, s2, y, rw, sorted_ids, expert_of_block, n_pairs, D, I, W_FMT=fmt, BLOCK_M=bm, DOT_F32=_INTERPRET, **dn)
    _sum_topk_kernel[(T, triton.cdiv(D, 1024))](y, idx, out, T, D, TOPK=k, BLOCK=1024)
    return out
