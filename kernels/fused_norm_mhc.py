"""Fused Triton kernels: RMSNorm, mHC pre (mix GEMV + Sinkhorn + collapse) and post, and both fused
(Mega-mHC: a sublayer's post, the next one's pre and its RMSNorm). The router gate: kernels/fused_gate.py.

Each `*_fused` function has the signature of its torch reference in kernels/reference.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl, quant_configs, variants
from kernels.pdl import wait_and_release
from kernels.per_weight import PerWeight
from kernels.semaphores import semaphores

# --- RMSNorm ----------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     CAST_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """CAST_FIRST (V4.1's order): the normalised row rounded to x's dtype before the weight."""
    wait_and_release(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.rsqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=0) / D + eps)
    y = x.to(tl.float32) * r
    if CAST_FIRST:
        y = y.to(x.dtype).to(tl.float32)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                     HAS_W=True, BLOCK=triton.next_power_of_2(x2.shape[1]), **pdl.options(x2))
    return out.view_as(x)


def rms_norm_unweighted_fused(x: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                     HAS_W=False, BLOCK=triton.next_power_of_2(x2.shape[1]), **pdl.options(x2))
    return out.view_as(x)


# --- mHC pre: split-K mixing GEMV (+ the RMS) over many programs, then one kernel that reduces
# the partials, runs Sinkhorn in registers and collapses the 4 streams ---------------------------

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# fp32-accurate tensor-core dots (3 tf32 passes); the interpreter knows only "ieee"
_PRECISION = "ieee" if _INTERPRET else "tf32x3"


@triton.jit(do_not_specialize=["T"])
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, T, K, K_SPLIT, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """part[split, t, 0:24] = x[t, ks] @ fn[:, ks]^T, part[split, t, 24] = sum x[t, ks]^2"""
    wait_and_release(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tmask = t < T
    r32 = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_T, 32), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    k_lo = split * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        f = tl.load(fn_ptr + r32[:, None] * K + k[None, :], mask=(r32[:, None] < 24) & kmask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(f), input_precision=PRECISION)
    acc = tl.where(r32[None, :] == 24, sumsq[:, None], acc)
    tl.store(part_ptr + (split * T + t[:, None]) * 32 + r32[None, :], acc, mask=tmask[:, None] & (r32[None, :] < 25))


@triton.jit(do_not_specialize=["T"])
def _hc_mix_partial_pieces_kernel(x_ptr, pieces_ptr, part_ptr, T, K, K_SPLIT, PIECES: tl.constexpr,
                                  BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                                  PDL: tl.constexpr = False):
    """_hc_mix_partial_kernel's partials from bf16 x and fn's bf16 pieces [PIECES, 24, K] (fn = their sum to fp32
    precision), in one bf16 tensor-core dot per K step: the pieces stacked as the dot's columns (piece p's 24
    mixes at columns 32p..32p+23, the rest zero), each product exact and each piece's sum kept apart in fp32
    across K, the pieces added at the end; the sum of squares in fp32 as there. DOT_F32 (the interpreter, whose
    bf16 dot is wrong): the same operands as fp32 (exact) in an "ieee" dot, the same products and fp32 sums."""
    wait_and_release(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tmask = t < T
    r32 = tl.arange(0, 32)
    tl.static_assert(PIECES <= 4)
    n = tl.arange(0, 128)  # the dot's columns: piece n // 32, mix n % 32
    fmask = ((n % 32) < 24) & ((n // 32) < PIECES)
    frow = (n // 32) * 24 + n % 32
    acc = tl.zeros((BLOCK_T, 128), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    k_lo = split * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        f = tl.load(pieces_ptr + frow[:, None] * K + k[None, :], mask=fmask[:, None] & kmask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(xf, tl.trans(f.to(tl.float32)), acc, input_precision="ieee")
        else:  # the dot's operand from the registers sumsq reads (exact), as today's kernel has it; pipelined
            # (2-4 stages) the sums are wrong on the GPU either way, so the prefill launch is one stage (MIX_PIECES_TILES)
            acc = tl.dot(xf.to(tl.bfloat16), tl.trans(f), acc)
    mixes = tl.sum(tl.reshape(acc, (BLOCK_T, 4, 32)), axis=1)
    mixes = tl.where(r32[None, :] == 24, sumsq[:, None], mixes)
    tl.store(part_ptr + (split * T + t[:, None]) * 32 + r32[None, :], mixes,
             mask=tmask[:, None] & (r32[None, :] < 25))


@triton.jit
def _col(a, i: tl.constexpr):
    """Column i of a [BLOCK_T, 16] tile as [BLOCK_T, 1]."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == i, a, 0.0), axis=1)[:, None]


@triton.jit(do_not_specialize=["T"])
def _hc_finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, pre_in_ptr, pre_out_ptr,
                      T, D, N_SPLIT, hc_eps, norm_eps, out_eps, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_D: tl.constexpr, PW: tl.constexpr, NORM: tl.constexpr, SINGLE_PASS: tl.constexpr,
                      SPLITS_AT_ONCE: tl.constexpr, PDL: tl.constexpr = False):
    """Sums the split partials (PW floats per token: 24 mixes, the sum of squares, and with NORM the
    streams' 4x4 Gram matrix), Sinkhorn in registers, collapses the streams; NORM: then the weighted
    RMSNorm of the collapsed row, whose sum of squares is pre^T Gram pre (no second pass over D).
    SINGLE_PASS (V4.1): stores this site's pre and collapses with the previous site's (pre_in)."""
    wait_and_release(PDL)
    _hc_finish_tile(x_ptr, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, pre_in_ptr, pre_out_ptr,
                    tl.program_id(0) * BLOCK_T, tl.program_id(1), T, D, N_SPLIT, hc_eps, norm_eps, out_eps, ITERS,
                    BLOCK_T, BLOCK_D, PW, NORM, SINGLE_PASS, SPLITS_AT_ONCE, False)


@triton.jit
def _hc_finish_tile(x_ptr, part_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, pre_in_ptr, pre_out_ptr,
                    t0, pid_d, T, D, N_SPLIT, hc_eps, norm_eps, out_eps, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr, PW: tl.constexpr, NORM: tl.constexpr, SINGLE_PASS: tl.constexpr,
                    SPLITS_AT_ONCE: tl.constexpr, VOLATILE: tl.constexpr):
    """The finish of tokens t0 + (0..BLOCK_T), columns block pid_d (post and comb stored by block 0). VOLATILE:
    the partials and the streams x were stored by other programs of this launch (Mega-mHC in one launch), so
    read from L2, never a stale L1 line."""
    HC: tl.constexpr = 4
    t = t0 + tl.arange(0, BLOCK_T)
    tmask = t < T
    r16 = tl.arange(0, 16)
    pre_w = tl.zeros((BLOCK_T, 16), tl.float32)
    post_w = tl.zeros((BLOCK_T, 16), tl.float32)
    comb_w = tl.zeros((BLOCK_T, 16), tl.float32)
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    small = tmask[:, None] & (r16[None, :] < HC)
    gram = tl.zeros((BLOCK_T, 16), tl.float32)  # NORM: entries 0..9 of the upper triangle, row by row
    for sp0 in range(0, N_SPLIT, SPLITS_AT_ONCE):  # several splits' loads in flight: L2 latency, not 64 round trips
        sp = sp0 + tl.arange(0, SPLITS_AT_ONCE)
        spm = (sp < N_SPLIT)[:, None, None]
        row = part_ptr + (sp[:, None, None] * T + t[None, :, None]) * PW + r16[None, None, :]
        pre_w += tl.sum(tl.load(row, mask=spm & small[None, :, :], other=0.0, volatile=VOLATILE), axis=0)
        post_w += tl.sum(tl.load(row + HC, mask=spm & small[None, :, :], other=0.0, volatile=VOLATILE), axis=0)
        comb_w += tl.sum(tl.load(row + 2 * HC, mask=spm & tmask[None, :, None], other=0.0, volatile=VOLATILE),
                         axis=0)
        sumsq += tl.sum(tl.sum(tl.load(row + 24, mask=spm & tmask[None, :, None] & (r16[None, None, :] == 0),
                                       other=0.0, volatile=VOLATILE), axis=2), axis=0)
        if NORM:
            gram += tl.sum(tl.load(row + 25, mask=spm & tmask[None, :, None] & (r16[None, None, :] < 10), other=0.0,
                                   volatile=VOLATILE), axis=0)
    # the unweighted RMSNorm of the flattened streams is one scalar per token: it factors out
    r = tl.rsqrt(sumsq / (HC * D) + norm_eps)[:, None]
    b_pre = tl.load(base_ptr + r16, mask=r16 < HC, other=0.0)
    pre = tl.sigmoid(pre_w * r * tl.load(scale_ptr) + b_pre[None, :]) + hc_eps
    if pid_d == 0:
        b_post = tl.load(base_ptr + HC + r16, mask=r16 < HC, other=0.0)
        post = 2 * tl.sigmoid(post_w * r * tl.load(scale_ptr + 1) + b_post[None, :])
        logits = comb_w * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + r16)[None, :]
        logits = tl.reshape(logits, (BLOCK_T, HC, HC))
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(ITERS - 1):  # Sinkhorn-Knopp, in registers
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t[:, None] * 16 + r16[None, :], tl.reshape(comb, (BLOCK_T, 16)), mask=tmask[:, None])
        tl.store(post_ptr + t[:, None] * HC + r16[None, :], post, mask=small)
        if SINGLE_PASS:
            tl.store(pre_out_ptr + t[:, None] * HC + r16[None, :], pre, mask=small)
    if SINGLE_PASS:
        pre = tl.load(pre_in_ptr + t[:, None] * HC + r16[None, :], mask=small, other=0.0)
    p0 = tl.sum(tl.where(r16[None, :] == 0, pre, 0.0), axis=1)[:, None]
    p1 = tl.sum(tl.where(r16[None, :] == 1, pre, 0.0), axis=1)[:, None]
    p2 = tl.sum(tl.where(r16[None, :] == 2, pre, 0.0), axis=1)[:, None]
    p3 = tl.sum(tl.where(r16[None, :] == 3, pre, 0.0), axis=1)[:, None]
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tmask[:, None] & (d[None, :] < D)
    base = x_ptr + t[:, None] * (HC * D) + d[None, :]
    y = p0 * tl.load(base, mask=m, other=0.0, volatile=VOLATILE).to(tl.float32)
    y += p1 * tl.load(base + D, mask=m, other=0.0, volatile=VOLATILE).to(tl.float32)
    y += p2 * tl.load(base + 2 * D, mask=m, other=0.0, volatile=VOLATILE).to(tl.float32)
    y += p3 * tl.load(base + 3 * D, mask=m, other=0.0, volatile=VOLATILE).to(tl.float32)
    if NORM:  # sum_d (sum_j p_j x_jd)^2 = sum_jk p_j p_k Gram_jk
        ss = p0 * p0 * _col(gram, 0) + p1 * p1 * _col(gram, 4) + p2 * p2 * _col(gram, 7) + p3 * p3 * _col(gram, 9)
        ss += 2.0 * (p0 * (p1 * _col(gram, 1) + p2 * _col(gram, 2) + p3 * _col(gram, 3))
                     + p1 * (p2 * _col(gram, 5) + p3 * _col(gram, 6)) + p2 * p3 * _col(gram, 8))
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        y = y * tl.rsqrt(ss / D + out_eps) * w[None, :]
    tl.store(out_ptr + t[:, None] * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


FINISH_WARPS = 4  # tuning knob for the Sinkhorn/collapse kernel (tools/tune_small_kernels.py)


def _finish_tiles(T: int, D: int, n_split: int) -> tuple[int, int, int]:
    """The finish's token tile, column block and splits loaded per step: decode's few tokens get a token tile no
    wider than the tokens (the Sinkhorn's reductions run over the whole tile) and every split's partials loaded
    in one step (each step waits on L2); 16 tokens and 8 splits a step past."""
    block_t = min(16, triton.next_power_of_2(T))
    return block_t, min(512, triton.next_power_of_2(D)), max(8, min(triton.next_power_of_2(n_split), 128 // block_t))


def _hc_finish(x, part, base, scale, out, norm_w, hc_eps, norm_eps, out_eps, sinkhorn_iters, pre_in=None,
               pre_out=None):
    """post, comb and the collapsed streams (weighted-RMSNorm'ed with norm_w) into `out`, from the partials;
    pre_in given (V4.1's single pass): collapsed with it, and this site's pre into pre_out."""
    T, hc, D = x.shape
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    BLOCK_T, BLOCK_D, splits_at_once = _finish_tiles(T, D, part.shape[0])
    _hc_finish_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))](
        x, part, base.float().contiguous(), scale.float().contiguous(), post, comb, out,
        out if norm_w is None else norm_w, post if pre_in is None else pre_in, post if pre_out is None else pre_out,
        T, D, part.shape[0], hc_eps, norm_eps, out_eps, ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
        PW=part.shape[-1], NORM=norm_w is not None, SINGLE_PASS=pre_in is not None, SPLITS_AT_ONCE=splits_at_once,
        num_warps=FINISH_WARPS, **pdl.options(x))
    return post, comb, out


MIX_WIDE_T = 256  # token count from which the mix partials take the prefill tiles


@dataclass(frozen=True)
class MixTiles:
    """The mix partials' launch at one size: token tile, K step, programs aimed at, pipeline stages, warps
    (stages / warps None: Triton's defaults)."""

    block_t: int
    block_k: int
    programs: int
    stages: int | None = None
    warps: int | None = None


# today's kernel: decode's 16-token tiles over up to 64 splits, prefill's 64-token tiles over the splits for
# 4 programs an SM, one pipeline stage: suite prefill_small_ops' sweep on the H100, 72.0 / 289.5 us at 2048 / 8192
# tokens against 86.5 / 347.2 at two stages (the fastest at 2048 tokens, the chunk a step prefills; 132 programs
# sum less over both sizes, 97.7 + 245.9, but lose at 2048). Stages change the loads' pipelining, not the sums.
MIX_TILES = {"decode": MixTiles(16, 128, 0), "prefill": MixTiles(64, 128, 4 * quant_configs.SMS, 1, 4)}
# mix_bf16x3 (kernels/variants.py): one pipeline stage at prefill. Pipelined (2-4 stages) it is wrong on the GPU at
# every prefill tile the sweep tries (0.15-0.47 of a column against fp64), with the loaded x tile handed to the
# dot from registers or not; right at one stage (2.5e-6 / 7.7e-6 at 2048 / 8192 tokens) and at the 16-token decode
# tiles (suite prefill_small_ops, H100)
MIX_PIECES_TILES = {"decode": MixTiles(16, 128, 0), "prefill": MixTiles(64, 128, 2 * quant_configs.SMS, 1)}
MIX_PIECES = 3  # bf16 pieces of fn: hi + mid + lo carry fp32's 24 significant bits


def _mix_grid(T: int, K: int, tiles: MixTiles) -> tuple[int, int]:
    """(splits of K, columns per split): decode enough splits to fill the GPU at T = 1 (up to 64); prefill only
    the splits that give tiles.programs programs (each token tile reads all of fn once from L2, and each split's
    partials go through memory to the finish kernel)."""
    block_k = min(tiles.block_k, triton.next_power_of_2(K))
    n_split = max(1, min(64, triton.cdiv(K, block_k)))
    if tiles.programs:
        n_split = max(1, min(n_split, triton.cdiv(tiles.programs, triton.cdiv(T, tiles.block_t))))
    k_split = triton.cdiv(triton.cdiv(K, n_split), block_k) * block_k
    return triton.cdiv(K, k_split), k_split


_pieces = PerWeight()


def mix_pieces(fn: torch.Tensor, pieces: int = 3) -> torch.Tensor:
    """fn [24, K] (fp32) as bf16 pieces [pieces, 24, K], largest first, each the rounded remainder of the ones
    before: their fp32 sum is fn to within its last bit (three pieces). Split once per weight (kernels/per_weight.py:
    again when it is written in place): the mixing weights do not change between steps."""
    hit = _pieces.get(fn, pieces)
    if hit is not None:
        return hit
    rest, out = fn.float(), []
    for _ in range(pieces):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].float()
    return _pieces.put(fn, torch.stack(out).contiguous(), pieces)


def _hc_mix_partials(x, fn, tiles: MixTiles | None = None):
    """The split-K partials of the 24 mixes and the sum of squares of x [T, 4, D] (contiguous); with the variant
    mix_bf16x3 and bf16 streams, from fn's bf16 pieces (tiles: a launch to time instead of the table's)."""
    T, hc, D = x.shape
    assert hc == 4, "the fused mHC kernel is written for 4 streams (DeepSeek-V4's hc_mult)"
    K = hc * D
    pieces = variants.on("mix_bf16x3") and x.dtype == torch.bfloat16
    if tiles is None:
        tiles = (MIX_PIECES_TILES if pieces else MIX_TILES)["prefill" if T >= MIX_WIDE_T else "decode"]
    n_split, k_split = _mix_grid(T, K, tiles)
    part = torch.empty(n_split, T, 32, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, tiles.block_t), n_split)
    launch = {k: v for k, v in (("num_stages", tiles.stages), ("num_warps", tiles.warps)) if v is not None}
    block_k = min(tiles.block_k, triton.next_power_of_2(K))
    if pieces:
        _hc_mix_partial_pieces_kernel[grid](x, mix_pieces(fn, MIX_PIECES), part, T, K, k_split, PIECES=MIX_PIECES,
                                            BLOCK_T=tiles.block_t, BLOCK_K=block_k, DOT_F32=_INTERPRET, **launch,
                                            **pdl.options(x))
    else:
        _hc_mix_partial_kernel[grid](x, fn.float().contiguous(), part, T, K, k_split, PRECISION=_PRECISION,
                                     BLOCK_T=tiles.block_t, BLOCK_K=block_k, **launch, **pdl.options(x))
    return part


def hc_pre_fused(x, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[2], dtype=x.dtype, device=x.device)
    return _hc_finish(x, _hc_mix_partials(x, fn), base, scale, out, None, hc_eps, norm_eps, 0.0, sinkhorn_iters)


def hc_site_collapse_fused(h, pre_in, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    """V4.1's single-pass site (kernels.deepseek_v41.reference.hc_site_collapse): hc_pre's two launches, the
    collapse using the previous site's pre."""
    h = h.contiguous()
    T, hc, D = h.shape
    pre = torch.empty(T, hc, dtype=torch.float32, device=h.device)
    out = torch.empty(T, D, dtype=h.dtype, device=h.device)
    post, comb, out = _hc_finish(h, _hc_mix_partials(h, fn), base, scale, out, None, hc_eps, norm_eps, 0.0,
                                 sinkhorn_iters, pre_in=pre_in.float().contiguous(), pre_out=pre)
    return pre, post, comb, out


# --- Mega-mHC: one sublayer's hc_post, the next sublayer's hc_pre and its RMSNorm in two launches (were
# four): kernel 1 writes the new streams and, from them still in registers, the next mix partials, the
# sum of squares and the streams' Gram matrix per split of D; the finish kernel above then normalises
# the collapsed row with the sum of squares pre^T Gram pre ----------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _hc_post_mix_kernel(h_ptr, blk_ptr, post_ptr, comb_ptr, fn_ptr, new_ptr, part_ptr, T, D, D_SPLIT,
                        PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PW: tl.constexpr,
                        base_ptr=None, scale_ptr=None, post2_ptr=None, comb2_ptr=None, x_ptr=None, w_ptr=None,
                        sem_ptr=None, hc_eps=0.0, norm_eps=0.0, out_eps=0.0, ITERS: tl.constexpr = 1,
                        FBLOCK_T: tl.constexpr = 16, FBLOCK_D: tl.constexpr = 512, SPLITS_AT_ONCE: tl.constexpr = 8,
                        FINISH: tl.constexpr = False, PDL: tl.constexpr = False):
    """new[t, k] = post[t, k] * blk[t] + sum_j comb[t, j, k] * h[t, j] over this split's columns, stored
    (rounded to h's dtype); part[split, t] = (the 24 mixes of the rounded streams with fn, their sum of
    squares, the 10 upper entries of their Gram matrix). FINISH (Mega-mHC in one launch): the last split of a
    token tile to finish (a counter per tile, kernels/semaphores.py) runs the finish kernel's work for the tile,
    in the finish kernel's FBLOCK_T x FBLOCK_D tiles (the same arithmetic), instead of that launch."""
    wait_and_release(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    tmask = t < T
    r32 = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_T, 32), tl.float32)
    g00 = tl.zeros((BLOCK_T,), tl.float32)
    g01 = tl.zeros((BLOCK_T,), tl.float32)
    g02 = tl.zeros((BLOCK_T,), tl.float32)
    g03 = tl.zeros((BLOCK_T,), tl.float32)
    g11 = tl.zeros((BLOCK_T,), tl.float32)
    g12 = tl.zeros((BLOCK_T,), tl.float32)
    g13 = tl.zeros((BLOCK_T,), tl.float32)
    g22 = tl.zeros((BLOCK_T,), tl.float32)
    g23 = tl.zeros((BLOCK_T,), tl.float32)
    g33 = tl.zeros((BLOCK_T,), tl.float32)
    cb = comb_ptr + t * 16
    for d0 in range(split * D_SPLIT, split * D_SPLIT + D_SPLIT, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = tmask[:, None] & (d[None, :] < D)
        b = tl.load(blk_ptr + t[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        row = h_ptr + t[:, None] * (4 * D) + d[None, :]
        x0 = tl.load(row, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(row + D, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + 2 * D, mask=m, other=0.0).to(tl.float32)
        x3 = tl.load(row + 3 * D, mask=m, other=0.0).to(tl.float32)
        n0 = _post_stream(b, x0, x1, x2, x3, post_ptr, cb, t, tmask, 0, new_ptr, D, d, m)
        n1 = _post_stream(b, x0, x1, x2, x3, post_ptr, cb, t, tmask, 1, new_ptr, D, d, m)
        n2 = _post_stream(b, x0, x1, x2, x3, post_ptr, cb, t, tmask, 2, new_ptr, D, d, m)
        n3 = _post_stream(b, x0, x1, x2, x3, post_ptr, cb, t, tmask, 3, new_ptr, D, d, m)
        fr = fn_ptr + r32[:, None] * (4 * D) + d[None, :]
        fm = (r32[:, None] < 24) & (d[None, :] < D)
        acc += tl.dot(n0, tl.trans(tl.load(fr, mask=fm, other=0.0)), input_precision=PRECISION)
        acc += tl.dot(n1, tl.trans(tl.load(fr + D, mask=fm, other=0.0)), input_precision=PRECISION)
        acc += tl.dot(n2, tl.trans(tl.load(fr + 2 * D, mask=fm, other=0.0)), input_precision=PRECISION)
        acc += tl.dot(n3, tl.trans(tl.load(fr + 3 * D, mask=fm, other=0.0)), input_precision=PRECISION)
        g00 += tl.sum(n0 * n0, axis=1)
        g01 += tl.sum(n0 * n1, axis=1)
        g02 += tl.sum(n0 * n2, axis=1)
        g03 += tl.sum(n0 * n3, axis=1)
        g11 += tl.sum(n1 * n1, axis=1)
        g12 += tl.sum(n1 * n2, axis=1)
        g13 += tl.sum(n1 * n3, axis=1)
        g22 += tl.sum(n2 * n2, axis=1)
        g23 += tl.sum(n2 * n3, axis=1)
        g33 += tl.sum(n3 * n3, axis=1)
    sumsq = g00 + g11 + g22 + g33
    out = part_ptr + (split * T + t) * PW
    tl.store(out[:, None] + r32[None, :], acc, mask=tmask[:, None] & (r32[None, :] < 24))
    tl.store(out + 24, sumsq, mask=tmask)
    tl.store(out + 25, g00, mask=tmask)
    tl.store(out + 26, g01, mask=tmask)
    tl.store(out + 27, g02, mask=tmask)
    tl.store(out + 28, g03, mask=tmask)
    tl.store(out + 29, g11, mask=tmask)
    tl.store(out + 30, g12, mask=tmask)
    tl.store(out + 31, g13, mask=tmask)
    tl.store(out + 32, g22, mask=tmask)
    tl.store(out + 33, g23, mask=tmask)
    tl.store(out + 34, g33, mask=tmask)
    if FINISH:
        tl.debug_barrier()  # every thread's streams and partials are stored before the counter's release
        tile = sem_ptr + tl.program_id(0)
        if tl.atomic_add(tile, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            tl.atomic_xchg(tile, 0)  # zero again (CUDA graphs replay it as is)
            for t0 in range(tl.program_id(0) * BLOCK_T, tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, T), FBLOCK_T):
                for pid_d in range(0, tl.cdiv(D, FBLOCK_D)):
                    _hc_finish_tile(new_ptr, part_ptr, base_ptr, scale_ptr, post2_ptr, comb2_ptr, x_ptr, w_ptr,
                                    post2_ptr, post2_ptr, t0, pid_d, T, D, tl.num_programs(1), hc_eps, norm_eps,
                                    out_eps, ITERS, FBLOCK_T, FBLOCK_D, PW, True, False, SPLITS_AT_ONCE, True)


@triton.jit
def _post_stream(b, x0, x1, x2, x3, post_ptr, cb, t, tmask, k: tl.constexpr, new_ptr, D, d, m):
    """New stream k over a [BLOCK_T, BLOCK_D] tile, stored, and returned as stored (float32)."""
    y = tl.load(post_ptr + t * 4 + k, mask=tmask, other=0.0)[:, None] * b
    y += tl.load(cb + k, mask=tmask, other=0.0)[:, None] * x0
    y += tl.load(cb + 4 + k, mask=tmask, other=0.0)[:, None] * x1
    y += tl.load(cb + 8 + k, mask=tmask, other=0.0)[:, None] * x2
    y += tl.load(cb + 12 + k, mask=tmask, other=0.0)[:, None] * x3
    y = y.to(new_ptr.dtype.element_ty)
    tl.store(new_ptr + t[:, None] * (4 * D) + k * D + d[None, :], y, mask=m)
    return y.to(tl.float32)


MEGA_SPLIT_D = 64  # columns per program of kernel 1: 64 programs at one token for D = 4096


def hc_post_pre_norm_fused(h, out, post, comb, fn, base, scale, norm_w, hc_eps, norm_eps, out_eps, sinkhorn_iters,
                           one_launch: bool = False):
    """Mega-mHC in two launches, or one_launch: the finish done by each token tile's last split (the same
    values: the finish kernel's tiles and arithmetic)."""
    T, hc, D = h.shape
    assert hc == 4, "the fused mHC kernel is written for 4 streams (DeepSeek-V4's hc_mult)"
    h, out = h.contiguous(), out.contiguous()
    BLOCK_T, BLOCK_D = 16, min(MEGA_SPLIT_D, triton.next_power_of_2(D))
    n_split = triton.cdiv(D, BLOCK_D)
    new = torch.empty_like(h)
    part = torch.empty(n_split, T, 48, dtype=torch.float32, device=h.device)
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    args = (h, out, post.float().contiguous(), comb.float().contiguous(), fn.float().contiguous(), new, part, T, D,
            BLOCK_D)
    grid = (triton.cdiv(T, BLOCK_T), n_split)
    if not one_launch:
        _hc_post_mix_kernel[grid](*args, PRECISION=_PRECISION, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PW=48,
                                  **pdl.options(h))
        post2, comb2, x = _hc_finish(new, part, base, scale, x, norm_w.float().contiguous(), hc_eps, norm_eps,
                                     out_eps, sinkhorn_iters)
        return new, post2, comb2, x
    post2 = torch.empty(T, hc, dtype=torch.float32, device=h.device)
    comb2 = torch.empty(T, hc, hc, dtype=torch.float32, device=h.device)
    fbt, fbd, at_once = _finish_tiles(T, D, n_split)
    _hc_post_mix_kernel[grid](*args, PRECISION=_PRECISION, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PW=48,
                              base_ptr=base.float().contiguous(), scale_ptr=scale.float().contiguous(),
                              post2_ptr=post2, comb2_ptr=comb2, x_ptr=x, w_ptr=norm_w.float().contiguous(),
                              sem_ptr=semaphores(h.device, grid[0]), hc_eps=hc_eps, norm_eps=norm_eps,
                              out_eps=out_eps, ITERS=sinkhorn_iters, FBLOCK_T=fbt, FBLOCK_D=fbd,
                              SPLITS_AT_ONCE=at_once, FINISH=True, **pdl.options(h))
    return new, post2, comb2, x


@triton.jit
def _hc_post_kernel(x_ptr, blk_ptr, post_ptr, comb_ptr, out_ptr, D, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, k, :] = post[t, k] * blk[t, :] + sum_j comb[t, j, k] * x[t, j, :]"""
    wait_and_release(PDL)
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    b = tl.load(blk_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + (t * 4 + 0) * D + d, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + (t * 4 + 1) * D + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + (t * 4 + 2) * D + d, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptr + (t * 4 + 3) * D + d, mask=m, other=0.0).to(tl.float32)
    for k in tl.static_range(4):
        y = tl.load(post_ptr + t * 4 + k) * b
        y += tl.load(comb_ptr + t * 16 + 0 * 4 + k) * x0
        y += tl.load(comb_ptr + t * 16 + 1 * 4 + k) * x1
        y += tl.load(comb_ptr + t * 16 + 2 * 4 + k) * x2
        y += tl.load(comb_ptr + t * 16 + 3 * 4 + k) * x3
        tl.store(out_ptr + (t * 4 + k) * D + d, y.to(out_ptr.dtype.element_ty), mask=m)


def hc_post_fused(x, out, post, comb):
    T, hc, D = x.shape
    assert hc == 4
    res = torch.empty_like(x)
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    _hc_post_kernel[(T, triton.cdiv(D, BLOCK_D))](x.contiguous(), out.contiguous(), post.float().contiguous(),
                                                  comb.float().contiguous(), res, D, BLOCK_D=BLOCK_D,
                                                  **pdl.options(x))
    return res
