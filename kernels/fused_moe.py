"""Fused MoE: expert GEMMs reading only the routed experts' stored bytes, the clamped SwiGLU in
the epilogue. Kernel 1: h = swiglu(x @ w1^T, x @ w3^T), both accumulators in one pass over x;
kernel 2: y = (h @ w2^T) * routing weight per (token, expert) pair; kernel 3 sums a token's k
rows. Same signature as kernels.reference.moe_experts.

Rows: the (token, expert) pairs grouped by expert and cut into BLOCK_M-row tiles per expert by one
alignment kernel (kernels/fused_moe_align.py); one program per (tile, N tile), swap-AB (weight
rows on the MMA's M side). BLOCK_M is chosen per step from the rows an expert can have
(quant_configs.moe_config): a tile that holds all of an expert's rows reads its weights once per
step, where 16-row tiles re-read them once per 16 rows; the engine picks among the tiles measured
faster (quant_configs.moe_block_m).

Stored expert formats (W_FMT): 0 dense, 1 FP8 e4m3 with 128x128 block scales (Base), 2 MXFP4
(V4-Flash), decoded in registers (kernels/fused_dequant.py: config "MX": "e4m3", the e4m3 bit
placement, or "bf16", integer ops straight to bf16; "bf16-frag", the same decode landing in the MMA's
operand registers, the MMA's K order permuted within each 128-wide step, the activations and h in that
order), or on the GPU with bf16 activations ("scaled") handed packed to tl.dot_scaled. Tiles:
kernels/quant_configs.py.

Prefill calls whose experts average enough rows go to kernels/moe_grouped.py instead (the experts unpacked to
bf16, then torch's grouped GEMM; quant_configs.moe_grouped says when).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import fusions, pdl, quant_configs, variants
from kernels.activations import clamped_swiglu
from kernels.fused_dequant import (
    fp8_rows_tile,
    frag_position,
    mxfp4_frag16_tile,
    mxfp4_frag_tile,
    mxfp4_rows_parts_bf16,
    mxfp4_rows_tile,
    mxfp4_rows_tile_bf16,
    to_frag_order,
    to_lane_major,
)
from kernels.fused_moe_align import moe_align_fused
from kernels.moe_gemv import moe_experts_gemv
from kernels.moe_gemv import takes as gemv_takes
from kernels.moe_grouped import moe_experts_grouped
from kernels.pdl import wait_and_release
from kernels.per_weight import PerWeight
from kernels.semaphores import semaphores, split_k_arrive, split_k_total

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # bf16 tl.dot is wrong in the interpreter
MX_SCALED_OK = not _INTERPRET  # tl.dot_scaled for MXFP4 (tests set it to run the interpreter's dot_scaled)
# MXFP4 decodes (config "MX"); "bf16-frag-one-mul": "bf16-frag" with one multiply a value pair, right only where every
# scale byte is at most ONE_MUL_MAX_SCALE (kernels/fused_dequant.py, _words_bf16): _tiles takes it only for weights
# whose bytes allow it (two multiplies elsewhere), so the variant moe_frag and a sweep may ask for it anywhere
ONE_MUL_MAX_SCALE = 128
MX_MODES = {"e4m3": 0, "scaled": 1, "bf16": 2, "bf16-parts": 3, "bf16-frag": 4, "bf16-frag-one-mul": 5,
            "bf16-frag16": 6, "bf16-frag16-one-mul": 7}
# "bf16-frag16": "bf16-frag" from weights arranged lane-major (arrange_lane_major; kernels/fused_dequant.py,
# mxfp4_frag16_tile). Only those: a call passes such weights with a "bf16-frag16" config for both parts, or fails.
GROUPED_OK = not _INTERPRET  # prefill through kernels/moe_grouped.py (tests set it to run that path on the CPU)
_MX_ASM = tl.constexpr(not _INTERPRET)  # the "bf16" decode's PTX; the interpreter runs the same bit operations in Triton


def weight_format(w: torch.Tensor, scale: torch.Tensor | None) -> int:
    if scale is None:
        return 0
    return 2 if w.dtype == torch.int8 else 1


FORMAT_NAMES = ("dense", "fp8", "mxfp4")


@triton.jit
def _expert_tile(w_ptr, s_ptr, e, n, k0, N, K, W_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 MX: tl.constexpr):
    """Expert e's [BLOCK_N, BLOCK_K] weight rows ([E, N, K] logical) and, for FP8, each row's
    block scale for this step (the caller scales the partial product; 1 otherwise)."""
    e64 = e.to(tl.int64)
    if W_FMT == 1:
        t, sw = fp8_rows_tile(w_ptr + e64 * N * K, s_ptr + e64 * tl.cdiv(N, 128) * tl.cdiv(K, 128), n, k0, N, K, BLOCK_K)
    elif W_FMT == 2 and MX == 2:
        t = mxfp4_rows_tile_bf16(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32), n, k0, N, K, BLOCK_N, BLOCK_K,
                                 _MX_ASM)
        sw = tl.full((BLOCK_N,), 1.0, tl.float32)
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
                DOT_F32: tl.constexpr, MX: tl.constexpr):
    """Expert e's rows n over K step k0 @ xt [BLOCK_K, BM], float32. MX == 1 (MXFP4 "scaled", bf16 xt, GPU):
    the packed e2m1 bytes and ue8m0 bytes go to tl.dot_scaled as stored, which unpacks them to bf16
    with byte permutes and integer ops (no conversion-unit instructions, which bound the e4m3
    placement at ~0.8 TB/s) and applies each 32-wide group's scale; loads stay 16-byte row-major. MX >= 4
    ("bf16-frag"): the tile decoded into the MMA's operand registers, its columns in the MMA's K order."""
    if W_FMT == 2 and MX >= 6:  # "bf16-frag16": weights lane-major (to_lane_major)
        e64 = e.to(tl.int64)
        t = mxfp4_frag16_tile(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32), n, k0, N, K, BLOCK_N, _MX_ASM,
                              MX == 7)
        res = _dot_wt(t, t, xt, 0, DOT_F32)
    elif W_FMT == 2 and MX >= 4:
        e64 = e.to(tl.int64)
        t = mxfp4_frag_tile(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32), n, k0, N, K, BLOCK_N, _MX_ASM,
                            MX == 5)
        res = _dot_wt(t, t, xt, 0, DOT_F32)
    elif W_FMT == 2 and MX == 3:
        e64 = e.to(tl.int64)
        o0, o1, o2, o3, o4, o5, o6, o7 = mxfp4_rows_parts_bf16(w_ptr + e64 * N * (K // 2), s_ptr + e64 * N * (K // 32),
                                                               n, k0, N, K, BLOCK_N, BLOCK_K, _MX_ASM)
        acc = _dot_wt(o0, o0, xt[0], 0, DOT_F32)
        acc += _dot_wt(o1, o1, xt[1], 0, DOT_F32)
        acc += _dot_wt(o2, o2, xt[2], 0, DOT_F32)
        acc += _dot_wt(o3, o3, xt[3], 0, DOT_F32)
        acc += _dot_wt(o4, o4, xt[4], 0, DOT_F32)
        acc += _dot_wt(o5, o5, xt[5], 0, DOT_F32)
        acc += _dot_wt(o6, o6, xt[6], 0, DOT_F32)
        acc += _dot_wt(o7, o7, xt[7], 0, DOT_F32)
        res = acc
    else:
        if W_FMT == 2 and MX == 1:
            e64 = e.to(tl.int64)
            KH = tl.multiple_of(K // 2, 16)  # K % 32 == 0 (the scale groups): rows 16-byte aligned, so 16-byte loads
            kb = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), 16), 16)
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            nmask = n < N
            w = tl.load(w_ptr + e64 * N * KH + n[:, None] * KH + kb[None, :],
                        mask=nmask[:, None] & (kb[None, :] < KH), other=0).to(tl.uint8, bitcast=True)
            sc = tl.load(s_ptr + e64 * N * (K // 32) + n[:, None] * (K // 32) + ks[None, :],
                         mask=nmask[:, None] & (ks[None, :] < K // 32), other=0)
            res = tl.dot_scaled(w, sc, "e2m1", xt, None, "bf16")
        else:
            t, sw = _expert_tile(w_ptr, s_ptr, e, n, k0, N, K, W_FMT, BLOCK_N, BLOCK_K, MX)
            res = _dot_wt(t, sw, xt, W_FMT, DOT_F32)
    return res


@triton.jit
def _act_tile(a_ptr, rows, valid, k0, K, BLOCK_K: tl.constexpr, MX: tl.constexpr):
    """The activations' [BLOCK_K, BLOCK_M] tile of rows `rows` (row stride K); for the "bf16-parts"
    decode the eight [BLOCK_K / 8, BLOCK_M] tiles its weight parts multiply (the q-th: K offset q of
    every 8), so the decoded weights go to the tensor cores without being interleaved first."""
    if MX == 3:
        kw = k0 + 8 * tl.arange(0, BLOCK_K // 8)
        base = a_ptr + rows[None, :] * K + kw[:, None]
        m = valid[None, :] & (kw[:, None] < K)  # K % 32 == 0: a word's 8 values are in range together
        return (tl.load(base, mask=m, other=0.0), tl.load(base + 1, mask=m, other=0.0),
                tl.load(base + 2, mask=m, other=0.0), tl.load(base + 3, mask=m, other=0.0),
                tl.load(base + 4, mask=m, other=0.0), tl.load(base + 5, mask=m, other=0.0),
                tl.load(base + 6, mask=m, other=0.0), tl.load(base + 7, mask=m, other=0.0))
    else:  # "bf16-frag" (MX >= 4): the activations come in its K order (moe_experts_fused)
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(a_ptr + rows[None, :] * K + k[:, None], mask=valid[None, :] & (k[:, None] < K), other=0.0)


@triton.jit
def _gate_up_tile(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, ws_ptr, tile_ptr, rows, tok, valid, e, n, D, I, limit,
                  pid_k, K_SPLIT, n_pairs, W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, MX: tl.constexpr, SPLITS: tl.constexpr,
                  H_FRAG: tl.constexpr):
    """h[rows, n] = SwiGLU(x[tok] @ w1[e].T, x[tok] @ w3[e].T) for one tile (decode and prefill alike);
    split-K (SPLITS > 1): this program's K range, the last split of the tile adds them and applies
    the SwiGLU (partials [SPLITS, pairs, 2, I] float32 at ws_ptr). H_FRAG: h's columns stored in the "bf16-frag"
    down projection's K order (kernels/fused_dequant.py, frag_position)."""
    hn = frag_position(n) if H_FRAG else n
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, D), BLOCK_K):
        xt = _act_tile(x_ptr, tok, valid, k0, D, BLOCK_K, MX)
        acc1 += _expert_dot(w1_ptr, s1_ptr, e, n, k0, I, D, xt, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX)
        acc3 += _expert_dot(w3_ptr, s3_ptr, e, n, k0, I, D, xt, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX)
    omask = valid[None, :] & (n[:, None] < I)
    if SPLITS > 1:
        off = rows[None, :] * (2 * I) + n[:, None]
        stride = n_pairs * 2 * I
        tl.store(ws_ptr + pid_k * stride + off + I, acc3, mask=omask)  # up; arrive stores gate and releases
        if split_k_arrive(ws_ptr, off, omask, acc1, tile_ptr, pid_k, stride, SPLITS):
            acc1 = split_k_total(ws_ptr, off, omask, acc1, pid_k, stride, SPLITS)
            acc3 = split_k_total(ws_ptr, off + I, omask, acc3, pid_k, stride, SPLITS)
            h = clamped_swiglu(acc1, acc3, limit)
            tl.store(h_ptr + rows[None, :] * I + hn[:, None], h.to(h_ptr.dtype.element_ty), mask=omask)
    else:
        h = clamped_swiglu(acc1, acc3, limit)
        tl.store(h_ptr + rows[None, :] * I + hn[:, None], h.to(h_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _down_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, ws_ptr, tile_ptr, rows, load_rows, valid, e, n, D, I,
               pid_k, K_SPLIT, n_pairs, W_FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, MX: tl.constexpr, SPLITS: tl.constexpr):
    """y[rows, n] = routing weight * (h[rows] @ w2[e].T) for one tile; `load_rows`: rows safe to address;
    split-K as in _gate_up_tile (partials [SPLITS, pairs, D])."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, I), BLOCK_K):
        ht = _act_tile(h_ptr, load_rows, valid, k0, I, BLOCK_K, MX)
        acc += _expert_dot(w2_ptr, s2_ptr, e, n, k0, D, I, ht, W_FMT, BLOCK_N, BLOCK_K, DOT_F32, MX)
    omask = valid[None, :] & (n[:, None] < D)
    off = rows[None, :] * D + n[:, None]
    last = True
    if SPLITS > 1:
        last = split_k_arrive(ws_ptr, off, omask, acc, tile_ptr, pid_k, n_pairs * D, SPLITS)
        if last:
            acc = split_k_total(ws_ptr, off, omask, acc, pid_k, n_pairs * D, SPLITS)
    if last:
        rw = tl.load(rw_ptr + load_rows, mask=valid, other=0.0).to(tl.float32)
        tl.store(y_ptr + off, acc * rw[None, :], mask=omask)


@triton.jit
def _tile_rows(sorted_ptr, block_expert_ptr, block_start_ptr, expert_end_ptr, pid_m, BLOCK_M: tl.constexpr):
    """Tile pid_m of the alignment: (its expert, -1 for an unused tile; its pair ids; which are real)."""
    e = tl.load(block_expert_ptr + pid_m)
    r = tl.load(block_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    valid = r < tl.load(expert_end_ptr + tl.maximum(e, 0))
    return e, tl.load(sorted_ptr + r, mask=valid, other=0), valid


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, ws_ptr, sem_ptr, sorted_ptr, block_expert_ptr,
                    block_start_ptr, expert_end_ptr, D, I, TOPK, limit, K_SPLIT, n_pairs, W_FMT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                    MX: tl.constexpr, SPLITS: tl.constexpr, H_FRAG: tl.constexpr = False, PDL: tl.constexpr = False):
    """One (expert tile of BLOCK_M pairs, N tile, K split); acc^T kept [BLOCK_N, BLOCK_M]."""
    wait_and_release(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, rows, valid = _tile_rows(sorted_ptr, block_expert_ptr, block_start_ptr, expert_end_ptr, pid_m, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _gate_up_tile(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, ws_ptr, sem_ptr + pid_m * tl.num_programs(1) + pid_n,
                  rows, rows // TOPK, valid, e, n, D, I, limit, pid_k, K_SPLIT, n_pairs,
                  W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX, SPLITS, H_FRAG)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, ws_ptr, sem_ptr, sorted_ptr, block_expert_ptr, block_start_ptr,
                 expert_end_ptr, D, I, K_SPLIT, n_pairs, W_FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, MX: tl.constexpr,
                 SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    wait_and_release(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, rows, valid = _tile_rows(sorted_ptr, block_expert_ptr, block_start_ptr, expert_end_ptr, pid_m, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _down_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, rw_ptr, ws_ptr, sem_ptr + pid_m * tl.num_programs(1) + pid_n, rows, rows,
               valid, e, n, D, I, pid_k, K_SPLIT, n_pairs, W_FMT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, MX, SPLITS)


@triton.jit(do_not_specialize=["T"])
def _sum_topk_kernel(y_ptr, idx_ptr, out_ptr, add_ptr, T, D, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                     ADD: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t] = the sum of token t's k expert rows; ADD: plus add[t] (the shared expert), after the sum's
    rounding to out's dtype, as `routed + shared` rounds."""
    wait_and_release(PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(TOPK):  # fixed order: the result does not depend on which program ran first
        e = tl.load(idx_ptr + t * TOPK + j)  # -1: another rank's expert, its row never written
        acc += tl.load(y_ptr + (t * TOPK + j) * D + d, mask=mask & (d * 0 + e >= 0), other=0.0)
    out = acc.to(out_ptr.dtype.element_ty)
    if ADD:
        out = (out.to(tl.float32) + tl.load(add_ptr + t * D + d, mask=mask, other=0.0).to(tl.float32))
        out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * D + d, out, mask=mask)


def _opts(cfg: dict) -> dict:
    """Launch options; "maxnreg" caps ptxas's registers a thread (more blocks an SM, maybe spills)."""
    if _INTERPRET:
        return {}
    cap = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3), **cap}


_scale_max_of = PerWeight()


def _scale_max(s: torch.Tensor) -> int | None:
    """The largest ue8m0 byte of an MXFP4 scale tensor, read once per weight (kernels/per_weight.py); None while a
    CUDA graph captures a weight never read before (no sync inside a capture)."""
    hit = _scale_max_of.get(s)
    if hit is not None or (s.is_cuda and torch.cuda.is_current_stream_capturing()):
        return hit
    return _scale_max_of.put(s, int(s.view(torch.uint8).max()))


def _one_mul_ok(scales: tuple) -> bool:
    """Whether "bf16-frag-one-mul" is exact for a part: every ue8m0 byte of its scale tensors <= ONE_MUL_MAX_SCALE
    (False where a byte is unknown: none given, or a capture reaching a weight never read)."""
    tops = [_scale_max(s) for s in scales]
    return bool(tops) and all(t is not None and t <= ONE_MUL_MAX_SCALE for t in tops)


def arrange_lane_major(w: torch.Tensor) -> torch.Tensor:
    """Stored MXFP4 expert weights [E, N, K/2] -> a copy arranged lane-major (kernels/fused_dequant.py,
    to_lane_major), which only the "bf16-frag16" decodes read, marked as such."""
    arranged = to_lane_major(w)
    arranged.lane_major = True  # an attribute of this tensor alone: a view or copy of it is not marked
    return arranged


def lane_major(w: torch.Tensor) -> bool:
    return getattr(w, "lane_major", False)


def with_mx(cfg: dict, mode: str) -> dict:
    """A {"gate_up", "down"} config whose integer bf16 MXFP4 decodes ("MX": "bf16", what the tables pick) take `mode`
    instead (the variant moe_frag; bench_quant --mx-ab's candidates)."""
    return {part: {**c, "MX": mode} if c.get("MX") == "bf16" else c for part, c in cfg.items()}


def _tiles(cfg: dict, fmt: int, act_dtype: torch.dtype, k_in: int = 0, scales: tuple = ()) -> dict:
    """The launch's tile constants; k_in: the part's K, scales: its MXFP4 scale tensors as stored (the "bf16-frag"
    decode reads whole 128-wide K steps and each row's four scale bytes as one 32-bit word, else it takes the "bf16"
    decode; one multiply a value pair only where every scale byte allows it, whoever asked for it: a table, the
    variant moe_frag or a sweep)."""
    cfg = {**cfg, **(quant_configs.INTERPRET_MOE if _INTERPRET else {})}
    if fmt == 1 and 128 % cfg["BLOCK_K"] or fmt == 2 and cfg["BLOCK_K"] % 32:
        raise ValueError(f"MoE BLOCK_K {cfg['BLOCK_K']} does not fit the {FORMAT_NAMES[fmt]} scale blocks")
    mx = cfg.get("MX", "e4m3")
    if mx not in MX_MODES:
        raise ValueError(f"MoE MX must be one of {sorted(MX_MODES)}, got {mx!r}")
    # dot_scaled's unpack needs bf16 activations and the GPU (the interpreter's float32 path checks the math)
    if mx == "scaled" and not (act_dtype == torch.bfloat16 and MX_SCALED_OK):
        mx = "e4m3"
    if mx == "bf16-parts" and fmt == 2:  # one K-16 MMA per part: the parts are BLOCK_K / 8 wide
        cfg = {**cfg, "BLOCK_K": max(cfg["BLOCK_K"], 128)}
    if mx.startswith("bf16-frag") and fmt == 2:
        frag = k_in % 128 == 0 and cfg["BLOCK_N"] % 16 == 0 and all(s.data_ptr() % 4 == 0 for s in scales)
        if not frag and mx.startswith("bf16-frag16"):  # its weights are lane-major: no other decode reads them
            raise ValueError(f"{mx} needs K % 128 == 0 (K = {k_in}), BLOCK_N % 16 == 0 ({cfg['BLOCK_N']}) and "
                             "4-byte aligned scales")
        cfg, mx = ({**cfg, "BLOCK_K": 128}, mx) if frag else (cfg, "bf16")
        if mx.endswith("-one-mul") and not _one_mul_ok(scales):
            mx = mx.removesuffix("-one-mul")
    return {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"], "MX": MX_MODES[mx] if fmt == 2 else 0, **_opts(cfg)}


def _grouped(x, n_pairs: int, E: int, fmt: int) -> bool:
    """Whether a call without a config goes to kernels/moe_grouped.py (prefill's many rows per expert)."""
    return (GROUPED_OK and x.dtype == torch.bfloat16 and quant_configs.moe_grouped(n_pairs, E, FORMAT_NAMES[fmt])
            and (not x.is_cuda or quant_configs.hopper(x.device)))


def _gemv(x, w1, scales) -> bool:
    """Whether a call without a config goes to kernels/moe_gemv.py (kernel variant moe_gemv: decode's few rows)."""
    return variants.on("moe_gemv") and gemv_takes(x.shape[0], w1, scales[0] if scales is not None else None)


def aligned_rows(x, w1, scales, n_pairs: int) -> int | None:
    """The BLOCK_M of the alignment moe_experts_fused makes for such a call (no config), or None where it makes
    none (the grouped path, no pairs): what a router that aligns the pairs itself must use."""
    fmt = weight_format(w1, scales[0] if scales is not None else None)
    E = w1.shape[0]
    if n_pairs == 0 or _grouped(x, n_pairs, E, fmt) or _gemv(x, w1, scales):
        return None
    return quant_configs.moe_config(x.shape[0], n_pairs, E, FORMAT_NAMES[fmt])["gate_up"]["BLOCK_M"]


def moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales=None, shared=None, config: dict | None = None,
                      aligned: tuple | None = None):
    """`config` ({"gate_up": cfg, "down": cfg}, tools/bench_quant.py's sweep) overrides
    kernels/quant_configs.py's entry; {"gemv": tiles}: the MXFP4 experts as kernels/moe_gemv.py's GEMVs in those
    tiles. `shared`: added in the top-k sum's launch with the fusion switch moe_shared_sum (kernels/fusions.py),
    else by one add after it. `aligned` (BLOCK_M, the alignment's four
    outputs): the pairs already aligned (by the router's launch: kernels.fused_gate), BLOCK_M aligned_rows'."""
    if shared is not None and not (fusions.on("moe_shared_sum") and shared.is_contiguous()):
        return moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales, config=config, aligned=aligned) + shared
    T, D = x.shape
    E, I = w1.shape[:2]
    k = indices.shape[1]
    s1, s3, s2 = scales if scales is not None else (None, None, None)
    fmt = weight_format(w1, s1)
    if fmt == 1:
        s1, s3, s2 = (s if s.dtype == torch.float32 and s.is_contiguous() else s.float().contiguous() for s in (s1, s3, s2))
    elif fmt == 2:  # ue8m0 bytes; triton reads them as uint8
        s1, s3, s2 = (s.contiguous().view(torch.uint8) for s in (s1, s3, s2))
        if any(w.data_ptr() % 16 for w in (w1, w3, w2)):  # the decodes load 16-byte vectors from each expert's start
            raise ValueError("MXFP4 expert weights must start 16-byte aligned")
    else:
        s1 = s3 = s2 = w1  # unused pointers
    n_pairs = T * k
    frag16 = config is not None and all(c.get("MX", "").startswith("bf16-frag16") for c in config.values())
    if fmt == 2 and lane_major(w1) != frag16 or frag16 and not all(lane_major(w) for w in (w1, w3, w2)):
        raise ValueError("the bf16-frag16 decode reads the MXFP4 experts arranged by arrange_lane_major, a config of "
                         "it for both parts, and nothing else reads those")
    if config is None and _grouped(x, n_pairs, E, fmt):
        out = moe_experts_grouped(x, w1, w3, w2, weights, indices, limit, scales)
        return out if shared is None else out + shared
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if n_pairs == 0:
        return out if shared is None else shared.clone()
    if config is None and _gemv(x, w1, scales) or config is not None and "gemv" in config:  # a sweep's GEMV tiles
        y = moe_experts_gemv(x, w1, w3, w2, scales, weights, indices, limit, tiles=(config or {}).get("gemv"))
        return _sum_topk(y, indices, out, shared)
    cfg = config or quant_configs.moe_config(T, n_pairs, E, FORMAT_NAMES[fmt])
    if config is None and fmt == 2 and variants.on("moe_frag"):  # one multiply where the scales allow it (_tiles)
        cfg = with_mx(cfg, "bf16-frag-one-mul")
    bm = cfg["gate_up"]["BLOCK_M"]
    if cfg["down"]["BLOCK_M"] != bm:
        raise ValueError(f"MoE gate_up and down share one alignment: BLOCK_M {bm} != {cfg['down']['BLOCK_M']}")
    stored = tuple(scales or ())  # as stored, by identity: the scale-byte check is cached per weight
    gu, dn = _tiles(cfg["gate_up"], fmt, x.dtype, D, stored[:2]), _tiles(cfg["down"], fmt, x.dtype, I, stored[2:])
    x = x if x.is_contiguous() else x.contiguous()
    x_in = to_frag_order(x) if gu["MX"] >= 4 else x  # the "bf16-frag" decode's K order (kernels/fused_dequant.py)
    rw = weights.reshape(-1)
    rw = rw if rw.is_contiguous() else rw.contiguous()
    h = torch.empty(n_pairs, I, dtype=x.dtype, device=x.device)
    y = torch.empty(n_pairs, D, dtype=torch.float32, device=x.device)
    if aligned is not None and aligned[0] != bm:
        raise ValueError(f"the pairs were aligned into {aligned[0]}-row tiles, this call's tiles are {bm} rows")
    sorted_ids, expert_end, block_expert, block_start = aligned[1] if aligned else moe_align_fused(indices, E, bm)
    layout = (sorted_ids, block_expert, block_start, expert_end)
    tiles = block_expert.numel()
    used = quant_configs.moe_used_tiles(n_pairs, E, bm)
    for part, n_out, k_in in (("gate_up", I, D), ("down", D, I)):
        c = gu if part == "gate_up" else dn
        n_tiles = triton.cdiv(n_out, c["BLOCK_N"])
        splits = quant_configs.moe_split_k(cfg[part], used * n_tiles, triton.cdiv(k_in, c["BLOCK_K"]))
        k_split = triton.cdiv(triton.cdiv(k_in, c["BLOCK_K"]), splits) * c["BLOCK_K"]
        splits = triton.cdiv(k_in, k_split)
        width = 2 * I if part == "gate_up" else D
        ws = torch.empty(splits, n_pairs, width, dtype=torch.float32, device=x.device) if splits > 1 else y
        sem = semaphores(x.device, tiles * n_tiles) if splits > 1 else y
        grid = (tiles, n_tiles, splits)
        if part == "gate_up":
            _gate_up_kernel[grid](x_in, w1, w3, s1, s3, h, ws, sem, *layout, D, I, k, limit, k_split, n_pairs,
                                  W_FMT=fmt, BLOCK_M=bm, DOT_F32=_INTERPRET, SPLITS=splits, H_FRAG=dn["MX"] >= 4,
                                  **gu, **pdl.options(x))
        else:
            _down_kernel[grid](h, w2, s2, y, rw, ws, sem, *layout, D, I, k_split, n_pairs,
                               W_FMT=fmt, BLOCK_M=bm, DOT_F32=_INTERPRET, SPLITS=splits, **dn, **pdl.options(h))
    return _sum_topk(y, indices, out, shared)


def _sum_topk(y, indices, out, shared):
    """out [T, D] = each token's k rows of y summed (rows of expert -1 skipped), plus `shared` where given."""
    T, D = out.shape
    idx = indices.reshape(-1)
    idx = idx if idx.is_contiguous() else idx.contiguous()
    _sum_topk_kernel[(T, triton.cdiv(D, 1024))](y, idx, out, out if shared is None else shared, T, D,
                                                TOPK=indices.shape[1], BLOCK=1024, ADD=shared is not None,
                                                **pdl.options(y))
    return out
