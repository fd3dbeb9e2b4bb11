"""The one API the engine calls for every hot op of DeepSeek-V4.

Dispatch lives here and only here (`_bind`, one line per op): a fused Triton kernel (kernels/fused.py's
FUSED) where one exists and the tensors are on CUDA, else the torch reference (kernels/reference.py, the
spec; V4.1's own ops, `v41_*`: kernels/deepseek_v41/reference.py).
`DSV4_KERNELS=ref` (or `set_backend("ref")`, the engine argument `kernels`) forces the
references everywhere; `set_backend("fused")` forces the kernels on any device (tests, with
TRITON_INTERPRET=1 on the CPU); `set_backend("rounded")`: the references in a float32 model, rounding to
bf16 where the served kernels store (kernels.reference.set_rounding; the teacher-forced check's reference);
`set_backend("reordered")`: the same, each contraction summed in another valid order (kernels.reference.
set_reordered; the teacher-forced check's noise floor).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from kernels import reference
from kernels.deepseek_v41 import reference as v41_reference

Op = TypeVar("Op", bound=Callable)
BACKENDS = ("auto", "ref", "rounded", "reordered", "fused")
ROUNDED = ("rounded", "reordered")  # the references in a float32 model, rounding as the served kernels store
_backend = os.environ.get("DSV4_KERNELS", "auto")
_references: dict[str, Callable] = {}  # public op name -> its torch reference, filled by _bind


def set_backend(name: str) -> None:
    """'auto' (fused on CUDA), 'ref' (torch references only), 'rounded' (the references, rounding as the served
    kernels store: run them in a float32 model), 'reordered' (as 'rounded', summing in another order) or 'fused'
    (kernels everywhere)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {name!r}")
    _backend = name
    _bind()


def backend() -> str:
    return _backend


def reference_of(name: str) -> Callable:
    """The torch reference an op of this API falls back to."""
    return _references[name]


def op_names() -> tuple[str, ...]:
    """Every public op, in dispatch order (V4's, then V4.1's `v41_*`)."""
    return tuple(_references)


def _fused_table() -> dict[str, Callable]:
    if _backend in ("ref", *ROUNDED):
        return {}
    try:
        from kernels import fused
    except ImportError:  # no triton: references only
        return {}
    return fused.FUSED


@functools.cache
def _on_cuda(fused: Callable, ref: Callable) -> Callable:
    """The kernel on CUDA tensors, the reference otherwise (CPU serving); cached: one wrapper per pair."""

    @functools.wraps(ref)
    def op(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return fused(*args, **kwargs) if first.is_cuda else ref(*args, **kwargs)
    return op


def _bind() -> None:
    """(Re)binds every public op for the backend (and the references' rounding); an op is its reference, then its
    kernel if FUSED has one."""
    global rms_norm, rms_norm_unweighted, rope_cos_sin, apply_rope, hc_pre, hc_post, hc_post_pre_norm, hc_head
    global router_topk, linear, linear_split, swiglu, swiglu_linear, mlp, moe_experts, sink_attention, grouped_linear
    global norm_linear, router_moe
    global indexer_scores, indexer_scores_paged, indexer_topk, paged_attention, pool_blocks, norm_rope
    global kv_norm_rope_insert, q_kv_norm_rope, compress_decode, compress_blocks, greedy_pick
    global sample_draw
    global v41_hc_site_collapse, v41_hc_expand, v41_rms_norm, v41_rope, v41_fake_quant_fp4, v41_fake_quant_fp8
    global v41_router, v41_clamped_swiglu, v41_moe_sum, v41_engram_gate, v41_engram_gather
    reference.set_rounding(torch.bfloat16 if _backend in ROUNDED else None)  # V4 serves in bf16
    reference.set_reordered(_backend == "reordered")
    fused = _fused_table()

    def op(name: str, ref: Op) -> Op:
        _references[name] = ref
        kernel = fused.get(name)
        if kernel is None:
            return ref
        return kernel if _backend == "fused" else _on_cuda(kernel, ref)

    rms_norm = op("rms_norm", reference.rms_norm)
    rms_norm_unweighted = op("rms_norm_unweighted", reference.rms_norm_unweighted)
    rope_cos_sin = op("rope_cos_sin", reference.rope_cos_sin)
    apply_rope = op("apply_rope", reference.apply_rope)
    hc_pre = op("hc_pre", reference.hc_pre)
    hc_post = op("hc_post", reference.hc_post)
    hc_post_pre_norm = op("hc_post_pre_norm", reference.hc_post_pre_norm)
    hc_head = op("hc_head", reference.hc_head)
    router_topk = op("router_topk", reference.router_topk)
    linear = op("linear", reference.linear)
    linear_split = op("linear_split", reference.linear_split)
    swiglu = op("swiglu", reference.swiglu)
    swiglu_linear = op("swiglu_linear", reference.swiglu_linear)
    norm_linear = op("norm_linear", reference.norm_linear)
    mlp = op("mlp", reference.mlp)
    moe_experts = op("moe_experts", reference.moe_experts)
    router_moe = op("router_moe", reference.router_moe)
    sink_attention = op("sink_attention", reference.sink_attention)
    grouped_linear = op("grouped_linear", reference.grouped_linear)
    indexer_scores = op("indexer_scores", reference.indexer_scores)
    indexer_scores_paged = op("indexer_scores_paged", reference.indexer_scores_paged)
    indexer_topk = op("indexer_topk", reference.indexer_topk)
    paged_attention = op("paged_attention", reference.paged_attention)
    pool_blocks = op("pool_blocks", reference.pool_blocks)
    norm_rope = op("norm_rope", reference.norm_rope)
    kv_norm_rope_insert = op("kv_norm_rope_insert", reference.kv_norm_rope_insert)
    q_kv_norm_rope = op("q_kv_norm_rope", reference.q_kv_norm_rope)
    compress_decode = op("compress_decode", reference.compress_decode)
    compress_blocks = op("compress_blocks", reference.compress_blocks)
    greedy_pick = op("greedy_pick", reference.greedy_pick)
    sample_draw = op("sample_draw", reference.sample_draw)
    # DeepSeek-V4.1's ops whose arithmetic differs from V4's
    v41_hc_site_collapse = op("v41_hc_site_collapse", v41_reference.hc_site_collapse)
    v41_hc_expand = op("v41_hc_expand", v41_reference.hc_expand)
    v41_rms_norm = op("v41_rms_norm", v41_reference.rms_norm)
    v41_rope = op("v41_rope", v41_reference.rope)
    v41_fake_quant_fp4 = op("v41_fake_quant_fp4", v41_reference.fake_quant_fp4)
    v41_fake_quant_fp8 = op("v41_fake_quant_fp8", v41_reference.fake_quant_fp8)
    v41_router = op("v41_router", v41_reference.router)
    v41_clamped_swiglu = op("v41_clamped_swiglu", v41_reference.clamped_swiglu)
    v41_moe_sum = op("v41_moe_sum", v41_reference.moe_sum)
    v41_engram_gate = op("v41_engram_gate", v41_reference.engram_gate)
    v41_engram_gather = op("v41_engram_gather", v41_reference.engram_gather)


_bind()
