"""Tensor-parallel attention and expert-parallel MoE: what one rank holds and the collectives it
joins (docs/PARALLEL.md says why it is cut this way).

A rank holds, per layer:
- attention: its num_heads / N query heads (wq_b rows, attn_sink) and the output projection's
  share for them (wo_a rows of its groups, or of its slice of one group when N > o_groups; wo_b
  columns of those groups). wo_a and wo_b are linear with nothing between them, so every rank's
  wo_b output is a partial sum of the layer's output: one all-reduce joins them;
- replicated: wq_a, q_norm, the shared KV latent (wkv, kv_norm), the compressors, the indexer,
  the router, norms, mHC, the embedding. Each rank computes them itself, so its KV cache is the
  whole latent cache (every head reads all of it) and no collective sits on that path;
- MoE with `enable_expert_parallel`: experts [r * E / N, (r + 1) * E / N), routed pairs of other
  ranks' experts skipped (index -1); without it every expert's intermediate slice. The shared
  expert is sliced by its intermediate dim either way. One all-reduce joins routed + shared;
- the LM head: rank 0 only (it samples); the other ranks stop after the last layer.
DeepSeek-V4.1 is cut the same way, plus its Engram tables split by rows
(engine/models/deepseek_v41/shards.py).
The input ids are broadcast from rank 0 at the start of each forward (with async scheduling its
last tokens exist only on rank 0's device). Both collectives are NCCL ops on the current stream,
so a decode CUDA graph captures them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.models.config import DeepseekConfig
from kernels.formats import FP8_BLOCK, MX_BLOCK

FULL = ()  # shard_spec: the whole tensor
SKIP = None  # shard_spec: not this rank's (another rank's expert, the head on rank > 0, MTP)


class ParallelConfigError(ValueError):
    """An unsupported parallel layout, refused at start (the message names the argument)."""


class CollectiveFailed(RuntimeError):
    """A tensor-parallel collective raised (gloo: a peer rank's connection closed): a rank is gone or the group
    is broken, so no later step can run. engine/recovery.py treats it as the engine's death, so the requests in
    flight fail UNAVAILABLE with the core, not one by one as a step's fault."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group. `share_only`: one rank's share built
    alone (tools/bench_tp_share.py): the collectives are skipped, the compute is the rank's."""

    rank: int = 0
    world: int = 1
    expert_parallel: bool = False
    share_only: bool = False

    @property
    def active(self) -> bool:
        return self.world > 1 and not self.share_only

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of n items split evenly."""
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def row_span(self, n: int) -> tuple[int, int]:
        """This rank's [lo, hi) of n rows that need not divide evenly (V4.1's Engram tables: prime
        bucket sums): every row on exactly one rank."""
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            try:
                torch.distributed.all_reduce(x)
            except RuntimeError as e:
                raise CollectiveFailed(f"tensor-parallel all_reduce failed: {e}") from e
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            try:
                torch.distributed.broadcast(x, src=0)
            except RuntimeError as e:
                raise CollectiveFailed(f"tensor-parallel broadcast failed: {e}") from e
        return x

    # --- shapes of this rank's share ----------------------------------------------------------

    def local_heads(self, cfg: DeepseekConfig) -> int:
        return cfg.num_heads // self.world

    def local_groups(self, cfg: DeepseekConfig) -> int:
        """Output groups this rank projects: whole groups, or one group's slice when N > o_groups."""
        return max(1, cfg.o_groups // self.world)

    def local_experts(self, cfg: DeepseekConfig) -> int:
        return cfg.n_routed_experts // self.world if self.expert_parallel else cfg.n_routed_experts

    def local_expert_width(self, cfg: DeepseekConfig) -> int:
        return cfg.moe_intermediate_size if self.expert_parallel else cfg.moe_intermediate_size // self.world

    def local_shared_width(self, cfg: DeepseekConfig) -> int:
        return cfg.moe_intermediate_size * cfg.n_shared_experts // self.world

    def expert_span(self, cfg: DeepseekConfig) -> tuple[int, int] | None:
        """The routed experts this rank holds, [lo, hi) of the global ids, where it holds some but not all (expert
        parallel); None where every expert is here. The routers take it (expert_span) and give this rank's ids,
        -1 for another rank's expert (kernels.reference.local_experts)."""
        return self.span(cfg.n_routed_experts) if self.expert_parallel and self.world > 1 else None


SINGLE = TensorParallel()

_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


def shard_spec(name: str, cfg: DeepseekConfig, tp: TensorParallel):
    """What of checkpoint tensor `name` this rank reads: SKIP, or slices ((dim, start, stop), ...)
    in the logical (unpacked) weight's coordinates, FULL (no slice) for all of it. Scales follow their weight (engine/models/weights.py)."""
    if tp.world == 1:
        return FULL
    if name.startswith("mtp."):
        return FULL if tp.rank == 0 else SKIP  # the MTP layer is not sharded (yet): rank 0's
    if name == "head.weight":
        return FULL if tp.rank == 0 else SKIP
    hd = cfg.head_dim
    h_lo, h_hi = tp.span(cfg.num_heads)
    if name.endswith(".attn.wq_b.weight"):
        return ((0, h_lo * hd, h_hi * hd),)
    if name.endswith(".attn.attn_sink"):
        return ((0, h_lo, h_hi),)
    if name.endswith((".attn.wo_a.weight", ".attn.wo_b.weight")):
        per_group = cfg.num_heads // cfg.o_groups  # heads per group
        g_lo = h_lo // per_group
        g_hi = max(g_lo + 1, h_hi // per_group)
        rows = g_lo * cfg.o_lora_rank, g_hi * cfg.o_lora_rank
        if name.endswith("wo_b.weight"):
            return ((1, *rows),)
        if tp.world <= cfg.o_groups:
            return ((0, *rows),)
        # N > o_groups: one group's rows, this rank's heads' slice of its input
        off = (h_lo - g_lo * per_group) * hd
        return (0, *rows), (1, off, off + (h_hi - h_lo) * hd)
    shared = re.search(r"\.ffn\.shared_experts\.(w[123])\.weight$", name)
    if shared:
        lo, hi = tp.span(cfg.moe_intermediate_size * cfg.n_shared_experts)
        return ((1 if shared.group(1) == "w2" else 0, lo, hi),)
    expert = _EXPERT.match(name)
    if expert:
        if tp.expert_parallel:
            lo, hi = tp.span(cfg.n_routed_experts)
            return FULL if lo <= int(expert.group(2)) < hi else SKIP
        lo, hi = tp.span(cfg.moe_intermediate_size)
        return ((1 if expert.group(3) == "w2" else 0, lo, hi),)
    return FULL


def local_expert_name(name: str, tp: TensorParallel, cfg: DeepseekConfig) -> str:
    """layers.N.ffn.experts.E.* -> this rank's expert number (expert parallel)."""
    m = _EXPERT.match(name)
    if m is None or not tp.expert_parallel or tp.world == 1:
        return name
    lo, _ = tp.span(cfg.n_routed_experts)
    return f"{m.group(1)}.{int(m.group(2)) - lo}.{m.group(3)}.{m.group(4)}"


def fp8_block(cfg: DeepseekConfig) -> int:
    """The FP8 tile edge of the checkpoint's linears: V4's 128, V4.1's `weight_block_size` (32)."""
    return getattr(cfg, "weight_block_size", (FP8_BLOCK, FP8_BLOCK))[0]


def check_parallel(cfg: DeepseekConfig, tensor_parallel_size: int, enable_expert_parallel: bool) -> None:
    """Refuse a layout this engine cannot split, naming the argument."""
    n = tensor_parallel_size
    if n == 1:
        return
    arg = f"tensor_parallel_size={n}"
    problems = []
    if cfg.num_heads % n:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by it")
    if cfg.o_groups % n and n % cfg.o_groups:
        problems.append(f"o_groups={cfg.o_groups} neither divides nor is divisible by it")
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    if shared % n:
        problems.append(f"the shared expert's width {shared} is not divisible by it")
    if enable_expert_parallel and cfg.n_routed_experts % n:
        problems.append(f"n_routed_experts={cfg.n_routed_experts} is not divisible by it (enable_expert_parallel)")
    if not enable_expert_parallel and cfg.moe_intermediate_size % n:
        problems.append(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by it "
                        "(or set enable_expert_parallel)")
    # slices of stored quantized weights must cut whole scale blocks
    if cfg.fp8_linears:
        block = fp8_block(cfg)
        per_rank = {"wq_b rows": cfg.num_heads // n * cfg.head_dim, "the shared expert's slice": shared // n,
                    "wo_a/wo_b group rows": max(1, cfg.o_groups // n) * cfg.o_lora_rank}
        if n > cfg.o_groups:
            per_rank["wo_a's slice of a group"] = cfg.num_heads // n * cfg.head_dim
        problems += [f"{k} per rank ({v}) is not a multiple of the FP8 block {block}" for k, v in per_rank.items()
                     if v % block]
    if not enable_expert_parallel and cfg.expert_dtype != "bf16":
        need = fp8_block(cfg) if cfg.expert_dtype == "fp8" else MX_BLOCK
        if (cfg.moe_intermediate_size // n) % need:
            problems.append(f"each rank's expert width {cfg.moe_intermediate_size // n} is not a multiple of the "
                            f"{cfg.expert_dtype} scale block {need} (set enable_expert_parallel)")
    if problems:
        raise ParallelConfigError(f"{arg} cannot split this model: " + "; ".join(problems))
