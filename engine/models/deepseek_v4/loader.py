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

from engine.models.deepseek_v4.config import load_config  # noqa: F401 - the registry's entry (engine/models/registry.py)
from engine.models.deepseek_v4.dspark import check_dspark_section
from engine.models.deepseek_v4.model import DeepseekV4
from engine.models.loading import device_bytes, load_named, resolve_dtype
from engine.models.stacked_linears import stack_linears
from engine.models.weights import iter_checkpoint
from engine.parallel import SINGLE, TensorParallel, local_expert_name, shard_spec

log = logging.getLogger(__name__)
Model = DeepseekV4  # the registry's entry: this family's ModelFamily class


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               quantized: bool | None = None, tokenizer: str | Path | None = None,
               tp: TensorParallel = SINGLE) -> DeepseekV4:
    """quantized: keep the stored formats (default: on CUDA, when the checkpoint is quantized).
    tokenizer: unused (V4 hashes no n-grams). tp: build and read only this rank's share (engine/parallel.py)."""
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
    if cfg.dspark is not None:  # the 0731 layout: its draft stages are checked now, kept as stored until drafted
        check_dspark_section(cfg, model.mtp_weights, quantized)
    stacked = stack_linears(model)  # linears reading one input: one launch per group (engine/models/stacked_linears.py)
    log.info("weights: %smodel on %s holds %.3f GB (%s; %d draft (mtp.*) tensors kept)",
             f"rank {tp.rank}/{tp.world}: " if tp.world > 1 else "", device, device_bytes(model) / 1e9,
             f"as stored, {stacked} linear groups stacked" if quantized else f"dequantized to {dtype}" if cfg.fp8_linears else str(dtype),
             len(model.mtp_weights))
    return model.eval()
