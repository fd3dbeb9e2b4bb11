"""The one API the engine calls for every hot op of DeepSeek-V4.

Dispatch lives here and only here: a fused Triton kernel where one exists and the
tensors are on CUDA, else the torch reference (kernels/reference.py, the spec; V4.1's own ops,
`v41_*`: kernels/reference_v41.py).
`DSV4_KERNELS=ref` (or `set_backend("ref")`, the engine argument `kernels`) forces the
references everywhere; `set_backend("fused")` forces the kernels on any device (tests, with
TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import os

from kernels import reference, reference_v41

_OPS = (
    "rms_norm", "rms_norm_unweighted", "rope_cos_sin", "apply_rope", "hc_pre", "hc_post", "hc_post_pre_norm", "hc_head",
    "router_topk", "linear", "linear_split", "swiglu", "mlp", "moe_experts", "sink_attention", "grouped_linear",
    "indexer_scores", "indexer_scores_paged", "indexer_topk", "paged_attention", "pool_blocks", "norm_rope",
    "kv_norm_rope_insert", "compress_decode", "compress_blocks", "greedy_pick",
)
# DeepSeek-V4.1's ops whose arithmetic differs from V4's (kernels/reference_v41.py): bound as v41_<name>
_V41_OPS = ("hc_site_collapse", "hc_expand", "rms_norm", "rope", "fake_quant_fp4", "fake_quant_fp8", "router",
            "clamped_swiglu", "moe_sum", "engram_gate")
_backend = os.environ.get("DSV4_KERNELS", "auto")


def set_backend(name: str) -> None:
    """'auto' (fused on CUDA), 'ref' (torch references only) or 'fused' (kernels everywhere)."""
    global _backend
    if name not in ("auto", "ref", "fused"):
        raise ValueError(f"kernels backend must be 'auto', 'ref' or 'fused', got {name!r}")
    _backend = name
    _bind()


def backend() -> str:
    return _backend


def _fused_ops() -> dict:
    if _backend == "ref":
        return {}
    try:
        from kernels import fused
    except ImportError:  # no triton: references only
        return {}
    return fused.FUSED if _backend == "fused" else fused.OPS


def reference_of(name: str):
    """The torch reference an op of this API falls back to (v41_<name>: kernels/reference_v41.py)."""
    if name.startswith("v41_"):
        return getattr(reference_v41, name[4:])
    return getattr(reference, name)


def _bind() -> None:
    fused = _fused_ops()
    for name in _OPS + tuple(f"v41_{n}" for n in _V41_OPS):
        globals()[name] = fused.get(name, reference_of(name))


_bind()
