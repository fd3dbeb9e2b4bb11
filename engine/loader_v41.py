"""Build a DeepSeek-V4.1 model for a checkpoint dir: config, empty weights, stream in, bind the
tokenizer (Engram). Both namings load: DeepSeek's official one and transformers' (translated by
engine/names_v41.py). `mtp.*` (DSpark draft layers), `vision.*`, `aligner.*` and `image_*`
tensors are not part of the text model: DSpark is kept aside, the vision tower skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config_v41 import load_v41_config
from engine.deepseek_v41 import DeepseekV41, engram_hasher
from engine.engram import find_tokenizer_json
from engine.loader import load_named
from engine.names_v41 import to_official
from engine.weights import WeightsError
from engine.weights_v41 import iter_v41_checkpoint, mxfp4_experts

log = logging.getLogger(__name__)
_NOT_TEXT = ("vision.", "aligner.", "image_", "model.vision", "model.aligner", "model.image_")


def load_v41_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                   tokenizer: str | Path | None = None, decoder_replay: bool = True,
                   experts_as_stored: bool | None = None) -> DeepseekV41:
    """experts_as_stored: routed MXFP4 experts kept packed for the fused MoE (default: on CUDA, when
    the checkpoint's experts are MXFP4); every other quantized weight is dequantized at load."""
    cfg = load_v41_config(model_dir)
    device = torch.device(device)
    if experts_as_stored is None:
        experts_as_stored = device.type == "cuda" and mxfp4_experts(model_dir)
    if experts_as_stored and cfg.expert_dtype != "fp4":
        raise WeightsError(f"{model_dir}: experts_as_stored needs MXFP4 experts; the config says {cfg.expert_dtype!r}")
    with torch.device("meta"):
        model = DeepseekV41(cfg, quantized=experts_as_stored, decoder_replay=decoder_replay)
    model.to_empty(device=device)
    model.cast(dtype)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    if model.engram_hasher is not None:
        model.engram_hasher = engram_hasher(cfg).to(device)  # its buffers were built on meta: rebuild
        model.engram_hasher.bind_tokenizer(find_tokenizer_json(model_dir, tokenizer), cfg.vocab_size)
        rows = model.engram_hasher.layout.table_rows()
        if list(rows) != list(cfg.engram_num_embeddings):
            raise WeightsError(f"{model_dir}: engram_num_embeddings {list(cfg.engram_num_embeddings)} do not match "
                               f"the hash layout's {rows}")
    load_named(model, _text_weights(model_dir, cfg.weight_block_size, device, experts_as_stored), device, model_dir)
    log.info("weights: DeepSeek-V4.1 on %s in %s%s (%d DSpark tensors kept aside)", device, dtype,
             ", routed experts as stored (MXFP4)" if experts_as_stored else "", len(model.mtp_weights))
    return model.eval()


def _text_weights(model_dir: str | Path, block: tuple[int, int], device: torch.device, keep_mxfp4: bool):
    """(official name, float tensor; packed experts with keep_mxfp4) of the text model and its DSpark layers."""
    for raw_name, raw in iter_v41_checkpoint(model_dir, block, device, keep_mxfp4):
        if raw_name.startswith(_NOT_TEXT):
            continue
        for name, tensor in to_official(raw_name, raw):
            # an Engram table's scale: the float table has it folded in already
            if name.startswith("mtp.") or not name.endswith("engram.embed.scale"):
                yield name, tensor
