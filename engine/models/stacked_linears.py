"""Linears of one layer that read the same input, stacked along N at load so one GEMM computes them
all. At batch 1 every launch costs microseconds over its bytes (a bf16 GEMM at one row is two on the
H200: cuBLAS split-K plus its reduce), so a group of n in one launch saves n - 1 per layer. Groups:
- attention's wq_a over wkv and the shared expert's w1 over w3 (FP8 pairs: K.linear_split writes
  both outputs contiguous in one launch, what their norm / SwiGLU kernels read);
- the attention input's small bf16 readers: the compressor's wkv and wgate, and in CSA layers the
  indexer compressor's wkv and wgate and the indexer's weights_proj (one K.linear; each output a
  column view of it, whose kernels take any row stride).

The modules keep their own weights, as views of the stacked tensor (no extra memory; names and
shapes unchanged, so tensor-parallel slicing and the state dict see nothing new; stacking runs after
each rank loaded its slices). FP8 members stack only where they share one scale block (128 V4, 32
V4.1) and every N before the last is a whole number of blocks: their scales then stack too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels as K
from kernels.formats import fp8_block_of

# the compressors' and the indexer's projections of the attention input, in stacking order
ATTENTION_X_READERS = ("compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate",
                       "indexer.weights_proj")


@dataclass(frozen=True)
class Group:
    names: tuple[str, ...]  # paths under the module; those it has (an HCA layer has no indexer) stack
    views: bool  # outputs as column views of one GEMM (their consumers take any row stride), else contiguous


GROUPS = {  # module class -> its groups
    "Attention": (Group(("wq_a", "wkv"), views=False), Group(ATTENTION_X_READERS, views=True)),
    "SharedExpert": (Group(("w1", "w3"), views=False),),
}


@dataclass(frozen=True, eq=False)
class Stacked:
    """What the first member of a stacked group holds (a plain attribute: not a parameter, not saved)."""
    members: tuple[nn.Module, ...]
    weight: torch.Tensor  # every member's rows, in order
    scale: torch.Tensor | None  # FP8: every member's block scales, in order
    bounds: tuple[int, ...]  # output column where each member starts, then the total
    views: bool


def members(module: nn.Module, names: tuple[str, ...]) -> tuple[nn.Module, ...]:
    """The linears of `names` that `module` has, in order."""
    out = []
    for name in names:
        try:
            out.append(module.get_submodule(name))
        except AttributeError:
            continue
    return tuple(out)


def stack_group(linears: tuple[nn.Module, ...], views: bool) -> bool:
    """Stack the linears' weights (and FP8 scales) into one tensor, theirs views of it; False (left
    apart) where they cannot: fewer than two, different inputs, devices or formats, an FP8 split off a
    scale block, or contiguous outputs (views=False) from anything but an FP8 pair's split launch."""
    if len(linears) < 2:
        return False
    ws = [m.weight for m in linears]
    scales = [getattr(m, "scale", None) for m in linears]
    fp8 = scales[0] is not None
    if any((s is not None) != fp8 for s in scales) or len({(w.shape[1], w.dtype, w.device) for w in ws}) > 1:
        return False
    if fp8:
        tiles = {fp8_block_of(w.shape, s.shape) for w, s in zip(ws, scales)}
        if len(tiles) > 1 or any(w.shape[0] % min(tiles) for w in ws[:-1]):
            return False
    if not views and not (fp8 and len(linears) == 2):
        return False  # only K.linear_split's FP8 kernel writes split outputs contiguous in one launch
    weight = torch.cat([w.data for w in ws])
    scale = torch.cat(scales) if fp8 else None
    bounds, rows, blocks = [0], 0, 0
    for m, w, s in zip(linears, ws, scales):
        w.data = weight[rows:rows + w.shape[0]]
        if fp8:
            m.scale = scale[blocks:blocks + s.shape[0]]
            blocks += s.shape[0]
        rows += w.shape[0]
        bounds.append(rows)
    linears[0].stacked = Stacked(tuple(linears), weight, scale, tuple(bounds), views)
    return True


def stack_linears(model: nn.Module) -> int:
    """Stack every group in GROUPS after the weights are loaded; the number stacked."""
    done = 0
    for module in model.modules():
        for group in GROUPS.get(type(module).__name__, ()):
            done += stack_group(members(module, group.names), group.views)
    return done


def linear_group(linears: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each linear of x: one launch where stack_group stacked them (outputs contiguous, or column views
    of one [.., N] result for a views group), else one each."""
    st = getattr(linears[0], "stacked", None)
    if st is None or st.members != tuple(linears):
        return tuple(m(x) for m in linears)
    if not st.views:
        return K.linear_split(x, st.weight, st.bounds[1], st.scale)
    y = K.linear(x, st.weight, st.scale)
    return tuple(y[..., a:b] for a, b in zip(st.bounds, st.bounds[1:]))
