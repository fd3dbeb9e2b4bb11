"""The fused ops the dispatcher in kernels/__init__.py may bind, by public op name (FUSED). The
dispatcher runs each on CUDA tensors and its torch reference otherwise (CPU serving stays on the
references; the tests call the kernels directly under TRITON_INTERPRET=1).

Integer arguments that change from step to step (token and pair counts, table widths, score-row
lengths) are marked `do_not_specialize` in their kernels: Triton would otherwise compile a new
variant the first time such a value is 1 or a multiple of 16, inside some request's step (a
half-second stall, seen at 8 users on the H200)."""

from __future__ import annotations

import torch

from kernels import fusions, reference, variants
from kernels.bf16_gemv import bf16_gemv
from kernels.bf16_gemv import takes as bf16_gemv_takes
from kernels.deepseek_v41 import fused as v41
from kernels.deepseek_v41.engram_gather import engram_gather_fused
from kernels.formats import fp8_block_of
from kernels.fused_attention import paged_attention_fused
from kernels.fused_compress import compress_decode_fused
from kernels.fused_compress_blocks import compress_blocks_fused
from kernels.fused_draw_wide import sample_draw_wide
from kernels.fused_fp8_linear import fp8_linear_fused, per_group_split, takes_prologue, tiles
from kernels.fused_gate import router_topk_fused, router_topk_gemm_fused
from kernels.fused_indexer import SORT_MAX, indexer_scores_paged, indexer_topk_fused
from kernels.fused_moe import aligned_rows, moe_experts_fused
from kernels.fused_norm_mhc import (
    hc_post_fused,
    hc_post_pre_norm_fused,
    hc_pre_fused,
    rms_norm_fused,
    rms_norm_unweighted_fused,
)
from kernels.fused_rope import (
    apply_rope_fused,
    kv_norm_rope_insert_fused,
    norm_rope_fused,
    q_kv_norm_rope_fused,
)
from kernels.fused_sample import greedy_pick_fused
from kernels.indexer_select import indexer_topk_select


def linear_fused(x, weight, scale=None):
    """FP8: kernels/fused_fp8_linear.py; a plain weight: cuBLAS (the reference), or at decode's few rows the GEMV
    of kernel variant bf16_gemv."""
    if scale is not None:
        return fp8_linear_fused(x, weight, scale)
    return bf16_gemv(x, weight) if bf16_gemv_takes(x, weight) else reference.linear(x, weight)


def linear_split_fused(x, weight, split_n, scale=None):
    """FP8: both outputs from one launch; a plain weight: the reference (one cuBLAS GEMM, two copies)."""
    if scale is None:
        return reference.linear_split(x, weight, split_n)
    return fp8_linear_fused(x, weight, scale, split_n=split_n)


GROUPED_ONE_LAUNCH_MAX_T = 32  # wo_a in one launch up to here, one launch per group past it (tools/bench_fused.py)


def grouped_linear_fused(x, weight, groups, scale=None):
    """FP8 wo_a: all groups in one launch at small batches, one launch per group at larger ones (where
    it measured faster: tools/bench_fused.py's wo_a rows, docs/perf/h200-2026-12-01-s5/fused.log, 3.2-3.4x at
    1 / 32 rows, 0.83x at 150: that one launch split K for all groups' tiles, so fewer splits and longer K ranges;
    kernel variant wo_a_one_launch launches the per-group programs, splits and all, at once), and from the cuBLAS
    rows (V4's blocks) one call that runs cuBLAS per group on x in place; needs whole scale blocks (128 V4, 32
    V4.1) per group."""
    rows = weight.shape[0] // groups
    block = None if scale is None else fp8_block_of(weight.shape, scale.shape)
    if scale is None or rows % block:
        return reference.grouped_linear(x, weight, groups, scale)
    m = x.numel() // (groups * x.shape[-1])
    if m <= GROUPED_ONE_LAUNCH_MAX_T or tiles(m, rows, x.shape[-1], block=block)[0] == "cublas":
        return fp8_linear_fused(x, weight, scale, groups=groups)  # cuBLAS: one call, each group read in place
    one = per_group_split(m, rows, x.shape[-1], block) if variants.on("wo_a_one_launch") else None
    if one is not None:  # the per-group launches' programs in one launch: no concatenation, one launch's tail
        return fp8_linear_fused(x, weight, scale, config=one, groups=groups)
    blk = rows // block
    return torch.cat([fp8_linear_fused(x[:, g], weight[g * rows:(g + 1) * rows], scale[g * blk:(g + 1) * blk])
                      for g in range(groups)], dim=-1)


def hc_post_pre_norm_composed(h, out, post, comb, fn, base, scale, norm_w, hc_eps, norm_eps, out_eps,
                              sinkhorn_iters):
    """Mega-mHC as the three fused ops, which the two-launch kernel did not beat alone on the H200 (tools/bench_fused.py,
    docs/perf/h200-2026-12-01-s5/fused.log: 0.83-0.90x); the two-launch kernel (hc_post_pre_norm_fused) with the
    fusion switch mega_mhc (kernels/fusions.py), one launch with mega_mhc_one."""
    if fusions.on("mega_mhc") or fusions.on("mega_mhc_one"):  # mega_mhc_one: its finish in the same launch
        return hc_post_pre_norm_fused(h, out, post, comb, fn, base, scale, norm_w, hc_eps, norm_eps, out_eps,
                                      sinkhorn_iters, one_launch=fusions.on("mega_mhc_one"))
    new = hc_post_fused(h, out, post, comb)
    post2, comb2, x = hc_pre_fused(new, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return new, post2, comb2, rms_norm_fused(x, norm_w, out_eps)


def router_topk_switched(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids=None, expert_span=None):
    """cuBLAS GEMM + one router kernel (measured faster alone), or Mega-Gate's one launch with the fusion
    switch mega_gate (kernels/fusions.py; hash layers in that launch too)."""
    fn = router_topk_fused if fusions.on("mega_gate") else router_topk_gemm_fused
    return fn(x, weight, bias, top_k, routed_scaling, scoring_func, hash_ids, expert_span=expert_span)


def router_moe_fused(x, gate_weight, gate_bias, top_k, routed_scaling, scoring_func, hash_ids, w1, w3, w2, limit,
                     scales=None, shared=None):
    """The router, then the routed experts: with the fusion switch align_in_router (kernels/fusions.py) the router's
    launch also aligns the pairs into the experts' row tiles (its last program: kernels.fused_gate's routers, the
    one router_topk_switched picks), one launch less; not for the cuBLAS router's hash layers or a gate without bias
    (the router aligns every gate row's pairs after a top-k), nor where the experts make no alignment (prefill's
    grouped path)."""
    mega = fusions.on("mega_gate")
    block_m = None
    if fusions.on("align_in_router") and gate_weight.shape[0] == w1.shape[0] and (
            (hash_ids is None and gate_bias is not None) or (mega and hash_ids is not None)):
        block_m = aligned_rows(x, w1, scales, x.shape[0] * top_k)
    if block_m is None:
        weights, indices = router_topk_switched(x, gate_weight, gate_bias, top_k, routed_scaling, scoring_func, hash_ids)
        return moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales, shared)
    router = router_topk_fused if mega else router_topk_gemm_fused
    weights, indices, layout = router(x, gate_weight, gate_bias, top_k, routed_scaling, scoring_func, hash_ids,
                                      align_m=block_m)
    return moe_experts_fused(x, w1, w3, w2, weights, indices, limit, scales, shared, aligned=(block_m, layout))


def indexer_topk_switched(iq, iw, index_pool, full_tables, positions, token_seq, ratio, topk, max_pos=None,
                          one_per_seq=False, iw_scale=1.0):
    """The indexer's selection, the same set either way: up to SORT_MAX entries a row, scores over the whole row
    and one sort (kernels.fused_indexer); past it (servers past 16K-token contexts, where that path ran torch.topk
    over the whole row), or everywhere with the kernel variant indexer_select, scores over what each token sees and
    a sort or radix select of those (kernels.indexer_select). Measured (suite kernels_indexer, 2026-12-07, H100):
    past SORT_MAX 1.17-780x faster at decode for 1K-64K contexts and 1.06x on a 32K prompt's chunk; up to it
    0.82-1.76x, slower at 8K contexts, so the sort stays there."""
    mp = int(max_pos if max_pos is not None else positions.max())  # one read of the longest position
    wide = (mp + 1) // ratio > SORT_MAX
    fn = indexer_topk_select if wide or variants.on("indexer_select") else indexer_topk_fused
    return fn(iq, iw, index_pool, full_tables, positions, token_seq, ratio, topk, mp, one_per_seq, iw_scale)


def swiglu_fused(gate, up, limit):
    """V4's shared-expert SwiGLU in one launch instead of four: V4.1's kernel (fp32 inside, one rounding
    to the input dtype, where the reference rounds after each op); the reference when nothing clamps."""
    if limit <= 0:
        return reference.swiglu(gate, up, limit)
    return v41.clamped_swiglu_fused(gate, up, limit, out_dtype=gate.dtype)


def swiglu_linear_fused(gate, up, limit, weight, scale=None):
    """The shared expert's w2 over its SwiGLU: two launches (swiglu_fused, then the linear), or with the fusion
    switch swiglu_gemv (kernels/fusions.py) one, the SwiGLU in the FP8 GEMV's prologue (same roundings)."""
    if fusions.on("swiglu_gemv") and scale is not None and limit > 0 and takes_prologue(gate.numel() // gate.shape[-1],
                                                                                       weight, scale):
        return fp8_linear_fused(gate, weight, scale, act=(up, limit))
    return linear_fused(swiglu_fused(gate, up, limit), weight, scale)


def norm_linear_fused(x, norm_weight, eps, weight, scale=None):
    """linear(rms_norm(x)): two launches (the RMSNorm kernel, then the linear), or with the fusion switch
    q_norm_gemv (kernels/fusions.py) one, the RMSNorm in the FP8 GEMV's prologue (one rounding to x's dtype in
    both; its sum of squares in another order)."""
    if fusions.on("q_norm_gemv") and scale is not None and takes_prologue(x.numel() // x.shape[-1], weight, scale):
        return fp8_linear_fused(x, weight, scale, norm=(norm_weight, eps))
    return linear_fused(rms_norm_fused(x, norm_weight, eps), weight, scale)


FUSED = {
    "norm_linear": norm_linear_fused,
    "linear": linear_fused,
    "linear_split": linear_split_fused,
    "grouped_linear": grouped_linear_fused,
    "swiglu": swiglu_fused,
    "swiglu_linear": swiglu_linear_fused,
    "rms_norm": rms_norm_fused,
    "rms_norm_unweighted": rms_norm_unweighted_fused,
    "hc_pre": hc_pre_fused,
    "hc_post": hc_post_fused,
    "hc_post_pre_norm": hc_post_pre_norm_composed,
    "router_topk": router_topk_switched,
    "paged_attention": paged_attention_fused,
    "moe_experts": moe_experts_fused,
    "router_moe": router_moe_fused,
    "norm_rope": norm_rope_fused,
    "apply_rope": apply_rope_fused,
    "kv_norm_rope_insert": kv_norm_rope_insert_fused,
    "q_kv_norm_rope": q_kv_norm_rope_fused,
    "compress_decode": compress_decode_fused,
    "compress_blocks": compress_blocks_fused,
    "indexer_scores_paged": indexer_scores_paged,
    "indexer_topk": indexer_topk_switched,
    "greedy_pick": greedy_pick_fused,
    # a row over many programs at every batch: faster than one program a row (kernels/fused_draw.py) and torch's
    # sort at 1-150 rows for every option (kernels_sample_draw, H100, 2026-12-07, docs/perf/h100-2026-12-07d/)
    "sample_draw": sample_draw_wide,
    "v41_hc_site_collapse": v41.hc_site_collapse_fused,
    "v41_hc_expand": v41.hc_expand_fused,
    "v41_rms_norm": v41.rms_norm_fused,
    "v41_rope": v41.rope_fused,
    "v41_fake_quant_fp4": v41.fake_quant_fp4_fused,
    "v41_fake_quant_fp8": v41.fake_quant_fp8_fused,
    "v41_router": v41.router_fused,
    "v41_clamped_swiglu": v41.clamped_swiglu_fused,
    "v41_moe_sum": v41.moe_sum_fused,
    "v41_engram_gate": v41.engram_gate_fused,
    "v41_engram_gather": engram_gather_fused,
}

