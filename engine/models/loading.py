"""Loading shared by every family: dtype names, streaming (name, tensor) pairs into a model,
the bytes a loaded model holds."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.models.weights import WeightsError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32, "float": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, default: str = "bfloat16") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = default if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def device_bytes(model: nn.Module) -> int:
    """Bytes the model holds: parameters, buffers and the kept MTP tensors."""
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None), *model.mtp_weights.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def load_named(model, named, device: torch.device, model_dir: str | Path) -> None:
    """Copy (official name, tensor) pairs into `model` (V4 and V4.1 alike): `mtp.*` kept aside,
    every expected name once; a WeightsError names what is missing or unexpected."""
    expected, loaded, unexpected = model.expected_names(), set(), []
    for name, tensor in named:
        if name.startswith("mtp."):
            model.load_weight(name, tensor.to(device))
        elif name not in expected:
            unexpected.append(name)
        else:
            model.load_weight(name, tensor.to(device))
            loaded.add(name)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise WeightsError(
            f"{model_dir}: checkpoint does not match the config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
