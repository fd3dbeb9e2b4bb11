"""Build the model for a checkpoint directory: config, empty weights on the device, stream in."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import load_config
from engine.deepseek_v4 import DeepseekV4
from engine.weights import WeightsError, iter_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32, "float": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, default: str = "bfloat16") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = default if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> DeepseekV4:
    cfg = load_config(model_dir)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    model.to_empty(device=device)
    model.cast(dtype)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    expected, loaded, unexpected = model.expected_names(), set(), []
    for name, tensor in iter_checkpoint(model_dir):
        if name not in expected:
            unexpected.append(name)
            continue
        model.load_weight(name, tensor.to(device))
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise WeightsError(
            f"{model_dir}: checkpoint does not match the config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    return model.eval()
