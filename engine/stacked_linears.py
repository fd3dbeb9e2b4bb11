"""FP8 linears of one layer that read the same input, stacked along N at load so one launch computes
both (K.linear_split): attention's wq_a over wkv (both read the attention norm's output) and the
shared expert's w1 over w3 (both read the FFN norm's output). At batch 1 each FP8 GEMV launch costs
several microseconds over its bytes, so a pair in one launch saves one per pair per layer.

The modules keep their own weights, as views of the stacked tensor (no extra memory; names and
shapes unchanged, so tensor-parallel slicing and the state dict see nothing new). Only FP8 pairs
with the first's N a whole number of 128-row scale blocks stack: their scales then stack too.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels as K
from kernels.formats import FP8_BLOCK

PAIRS = {"Attention": ("wq_a", "wkv"), "SharedExpert": ("w1", "w3")}  # module class -> (first, second)


def stack_pair(first: nn.Module, second: nn.Module) -> bool:
    """Stack second's weight and scale under first's; False (left apart) where they cannot stack."""
    w1, w2, s1, s2 = first.weight, second.weight, first.scale, second.scale
    if s1 is None or s2 is None or w1.shape[0] % FP8_BLOCK or w1.shape[1] != w2.shape[1] or w1.device != w2.device:
        return False
    n1, b1 = w1.shape[0], s1.shape[0]
    weight, scale = torch.cat([w1.data, w2.data]), torch.cat([s1, s2])
    w1.data, w2.data = weight[:n1], weight[n1:]
    first.scale, second.scale = scale[:b1], scale[b1:]
    first.stacked = (second, weight, scale)  # a plain attribute: not a parameter, not saved
    return True


def stack_linears(model: nn.Module) -> int:
    """Stack every pair in PAIRS after the weights are loaded; the number stacked."""
    done = 0
    for module in model.modules():
        names = PAIRS.get(type(module).__name__)
        if names and all(hasattr(module, n) for n in names):
            done += stack_pair(getattr(module, names[0]), getattr(module, names[1]))
    return done


def linear_pair(first: nn.Module, second: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)): one launch where stack_pair stacked them, else two."""
    stacked = getattr(first, "stacked", None)
    if stacked is None or stacked[0] is not second:
        return first(x), second(x)
    _, weight, scale = stacked
    return K.linear_split(x, weight, first.weight.shape[0], scale)
