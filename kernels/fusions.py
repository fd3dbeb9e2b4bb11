"""Which launch-saving fusions the decode path takes, one switch each, so one GPU run can time each
against the path it replaces at depth (suite decode_switches). Read at every call: CUDA graphs
captured after a change follow it.

    DSV4_FUSE=mega_mhc,mega_gate,moe_shared_sum,swiglu_gemv,inv_rope_out,q_kv_rope,q_norm_gemv,combine_last,
    mega_mhc_one,align_in_router   (or "all"; unset: DEFAULT)

- mega_mhc: hc_post + the next hc_pre + its RMSNorm in two launches (kernels.fused_norm_mhc.
  hc_post_pre_norm_fused) instead of four; twice a layer.
- mega_gate: the router in one launch, the gate GEMM inside (kernels.fused_gate.router_topk_fused),
  hash layers too, instead of cuBLAS + one router kernel (hash layers: the torch reference's ops).
- moe_shared_sum: the shared expert's output added in the routed experts' top-k sum (the same
  roundings: routed rounded first), not by a separate add; once a layer.
- swiglu_gemv: the shared expert's SwiGLU computed in its w2 FP8 GEMV's prologue (the same rounding),
  not by a separate kernel; once a layer (GEMV variants only: at prefill sizes the two launches stay).
- inv_rope_out: the attention output's inverse RoPE in the attention's store (or its split combine's),
  not by a separate rotation kernel; once a layer.
- q_kv_rope: attention's query norm + RoPE and its K=V latent's norm + RoPE + cache insert in one launch
  (kernels.fused_rope.q_kv_norm_rope_fused), not two; once a layer.
- q_norm_gemv: the query LoRA's RMSNorm (q_norm) computed in wq_b's FP8 GEMV prologue (kernels.fused.
  norm_linear_fused: one rounding, as the RMSNorm kernel), not by a separate kernel; once a layer outside CSA
  layers (their indexer reads the normed q too). GEMV variants only: at prefill sizes the two launches stay.
- combine_last: the split attention's combine done by the last split of each (token, head block) to finish
  (kernels.fused_attention, a counter per pair), not by its own launch; once a layer where keys are split (decode).
- mega_mhc_one: Mega-mHC in one launch: its finish (Sinkhorn, collapse, RMSNorm) done by each token tile's last
  split of the first kernel to finish (kernels.fused_norm_mhc, a counter per tile), with or without mega_mhc;
  twice a layer.
- align_in_router: the MoE's alignment (pairs grouped by expert, cut into row tiles) done by the router's last
  program to finish (kernels.fused_gate's routers' align_m: the cuBLAS one's, or Mega-Gate's with mega_gate), not by
  its own launch; once a layer (not with experts on other ranks, not prefill's grouped experts, not the cuBLAS
  router's hash layers, which run the torch reference).
"""

from __future__ import annotations

import os

ALL = ("mega_mhc", "mega_gate", "moe_shared_sum", "swiglu_gemv", "inv_rope_out", "q_kv_rope", "q_norm_gemv",
       "combine_last", "mega_mhc_one", "align_in_router")
DEFAULT: tuple[str, ...] = ()  # each measured slower alone on the H200 or not measured yet at depth


def parse(spec: str, choices: tuple[str, ...] = ALL, what: str = "fusions") -> frozenset[str]:
    """A comma list of switch names (or "all") -> the set; unknown names are a clear error (also kernels/variants.py's)."""
    names = choices if spec.strip() == "all" else tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = set(names) - set(choices)
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}: choose from {', '.join(choices)} (or 'all')")
    return frozenset(names)


_on = parse(os.environ.get("DSV4_FUSE", ",".join(DEFAULT)))


def set_fusions(spec: str | tuple[str, ...]) -> None:
    """Turn on exactly these fusions (a comma list, "all", or names); the rest off."""
    global _on
    _on = parse(spec if isinstance(spec, str) else ",".join(spec))


def on(name: str) -> bool:
    if name not in ALL:
        raise ValueError(f"unknown fusion {name!r}")
    return name in _on


def enabled() -> tuple[str, ...]:
    return tuple(n for n in ALL if n in _on)
