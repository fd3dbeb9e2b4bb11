"""Build the model for a checkpoint directory: config, empty weights on the device, stream in.

On CUDA a quantized checkpoint stays as stored (FP8 linears, FP8 / MXFP4 experts, their scales);
device memory is then the stored bytes plus one documented extra: ue8m0 FP8 block scales are held
as float32 (4 bytes per 128x128 block, 0.02% of the weight). On the CPU every quantized weight
is dequantized once, at load, to the compute dtype (no FP8 matmul there).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.models.deepseek_v4.config import load_config
from engine.models.deepseek_v4.model import DeepseekV4
from engine.models.deepseek_v41.config import is_v41
from engine.models.stacked_linears import stack_linears
from engine.models.weights import WeightsError, iter_checkpoint
from engine.parallel import SINGLE, TensorParallel, local_expert_name, shard_spec

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32, "float": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, default: str = "bfloat16") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = default if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def device_bytes(model: DeepseekV4) -> int:
    """Bytes the model holds: parameters, buffers and the kept MTP tensors."""
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None), *model.mtp_weights.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               quantized: bool | None = None, tokenizer: str | Path | None = None,
               tp: TensorParallel = SINGLE) -> DeepseekV4:
    """quantized: keep the stored formats (default: on CUDA, when the checkpoint is quantized).
    A DeepSeek-V4.1 checkpoint (its model_type) loads through engine/models/deepseek_v41/loader.py; `tokenizer`
    is where its Engram hashing finds tokenizer.json (default: the model dir). tp: build and read
    only this rank's share (engine/parallel.py; V4 only)."""
    if is_v41(model_dir):
        from engine.models.deepseek_v41.config import load_v41_config
        from engine.models.deepseek_v41.loader import load_v41_model

        return load_v41_model(model_dir, resolve_dtype(dtype, load_v41_config(model_dir).torch_dtype), device,
                              tokenizer=tokenizer)
    cfg = load_config(model_dir)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    device = torch.device(device)
    if quantized is None:
        quantized = device.type == "cuda" and (cfg.fp8_linears or cfg.expert_dtype != "bf16")
    with torch.device("meta"):
        model = DeepseekV4(cfg, quantized, tp)
    model.to_empty(device=device)
    model.cast(dtype)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    shard = None if tp.world == 1 else lambda name: shard_spec(name, cfg, tp)
    load_named(model, ((local_expert_name(name, tp, cfg), tensor)
                       for name, tensor in iter_checkpoint(model_dir, dequantize=not quantized, shard=shard)),
               device, model_dir)
    stacked = stack_linears(model)  # linears reading one input: one launch per group (engine/models/stacked_linears.py)
    log.info("weights: %smodel on %s holds %.3f GB (%s; %d MTP tensors kept)",
             f"rank {tp.rank}/{tp.world}: " if tp.world > 1 else "", device, device_bytes(model) / 1e9,
             f"as stored, {stacked} linear groups stacked" if quantized else f"dequantized to {dtype}" if cfg.fp8_linears else str(dtype),
             len(model.mtp_weights))
    return model.eval()


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
