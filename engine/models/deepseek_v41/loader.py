"""Build a DeepSeek-V4.1 model for a checkpoint dir: config, empty weights, stream in, bind the
tokenizer (Engram). Both namings load: DeepSeek's official one and transformers' (translated by
engine/models/deepseek_v41/names.py). `mtp.*` (DSpark draft layers), `vision.*`, `aligner.*` and `image_*`
tensors are not part of the text model: DSpark is kept aside, the vision tower skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.models.deepseek_v41.config import load_config
from engine.models.deepseek_v41.engram import find_tokenizer_json
from engine.models.deepseek_v41.engram_tables import HostTables, choose_placement, read_stored_table
from engine.models.deepseek_v41.mapped_tables import MappedTables
from engine.models.deepseek_v41.memory_plan import plan_memory
from engine.models.deepseek_v41.model import DeepseekV41, engram_hasher, hold_fp32_weights
from engine.models.deepseek_v41.names import official_name, to_official
from engine.models.deepseek_v41.shards import is_table, slice_loaded, table_names, table_span, v41_shard_spec
from engine.models.deepseek_v41.weights import iter_v41_checkpoint, mxfp4_experts
from engine.models.loading import device_bytes, load_named, resolve_dtype
from engine.models.stacked_linears import stack_linears
from engine.models.weights import WeightsError
from engine.parallel import SINGLE, SKIP, TensorParallel, local_expert_name

log = logging.getLogger(__name__)
_NOT_TEXT = ("vision.", "aligner.", "image_", "model.vision", "model.aligner", "model.image_")


Model = DeepseekV41  # the registry's entry: this family's ModelFamily class


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               tokenizer: str | Path | None = None, decoder_trim: bool = True,
               experts_as_stored: bool | None = None, linears_as_stored: bool | None = None,
               tp: TensorParallel = SINGLE, engram_tables: str = "auto") -> DeepseekV41:
    """tokenizer: where the Engram hashing finds tokenizer.json (default: the model dir).
    experts_as_stored: routed MXFP4 experts kept packed for the fused MoE (default: on CUDA, when
    the checkpoint's experts are MXFP4). linears_as_stored: the FP8 linears kept in e4m3 with their
    tile scales for the FP8 kernels (default: on CUDA, when the config says FP8 linears; on the CPU
    the torch reference dequantizes them per call). What stays dequantized: engine/models/deepseek_v41/weights.py.
    tp: build and read only this rank's share (engine/models/deepseek_v41/shards.py). engram_tables:
    where the Engram tables live: device, host (a copy in RAM the GPU reads: engine/models/deepseek_v41/mapped_tables.py),
    mmap (the checkpoint's pages, gathered by host threads) or auto (by size; engine/models/deepseek_v41/engram_tables.py)."""
    cfg = load_config(model_dir)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    device = torch.device(device)
    if experts_as_stored is None:
        experts_as_stored = device.type == "cuda" and mxfp4_experts(model_dir)
    if experts_as_stored and cfg.expert_dtype != "fp4":
        raise WeightsError(f"{model_dir}: experts_as_stored needs MXFP4 experts; the config says {cfg.expert_dtype!r}")
    if linears_as_stored is None:
        linears_as_stored = device.type == "cuda" and cfg.fp8_linears
    if linears_as_stored and not cfg.fp8_linears:
        raise WeightsError(f"{model_dir}: linears_as_stored needs FP8 linears; the config has no FP8 quantization_config")
    spans = {layer: table_span(cfg, layer, tp) for layer in cfg.engram_layer_ids}
    table_bytes = sum(hi - lo for lo, hi in spans.values()) * cfg.engram_head_dim * dtype.itemsize
    placement = choose_placement(engram_tables, table_bytes, device)
    plan = plan_memory(model_dir, cfg, tp, placement, device, dtype)
    for line in plan.lines(tp):
        log.info("memory plan: %s", line)
    plan.check(tp)  # refused before anything is read
    with torch.device("meta"):
        model = DeepseekV41(cfg, quantized=experts_as_stored, decoder_trim=decoder_trim,
                            fp8_linears=linears_as_stored, tp=tp, engram_on_device=placement == "device")
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
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    on_host = placement != "device"

    def shard(name: str):  # what this rank reads (the tables in host memory: read below, not here)
        return SKIP if on_host and is_table(name) else v41_shard_spec(name, cfg, tp)

    if on_host:
        stored = {layer: read_stored_table(model_dir, table_names(layer), *spans[layer]) for layer in cfg.engram_layer_ids}
        if placement == "host":
            model.host_tables = MappedTables(stored, spans, dtype, device, copy=True)
        else:
            model.host_tables = HostTables(stored, spans, dtype, device)
            model.host_hasher = engram_hasher(cfg)
            model.host_hasher.bind_tokenizer(find_tokenizer_json(model_dir, tokenizer), cfg.vocab_size)
    named = _text_weights(model_dir, cfg.weight_block_size, device, experts_as_stored, fp8, shard)
    load_named(model, ((local_expert_name(name, tp, cfg), tensor) for name, tensor in named), device, model_dir)
    stacked = stack_linears(model) if fp8 else 0  # wq_a over wkv, w1 over w3: one FP8 launch per pair
    hold_fp32_weights(model)
    if on_host:
        log.info("Engram: %s tables in host memory (%s, %.3f GB of rows%s)", len(spans),
                 "a copy the GPU reads" if placement == "host" else "memory-mapped from the checkpoint, host threads",
                 model.host_tables.nbytes / 1e9, f", rank {tp.rank}/{tp.world}'s share" if tp.world > 1 else "")
    log.info("weights: %sDeepSeek-V4.1 on %s in %s%s%s (%d DSpark tensors kept aside; %.3f GB)",
             f"rank {tp.rank}/{tp.world}: " if tp.world > 1 else "", device, dtype,
             ", routed experts as stored (MXFP4)" if experts_as_stored else "",
             f", {len(fp8)} FP8 linears as stored ({cfg.weight_block_size[0]}x{cfg.weight_block_size[1]} tiles, "
             f"{stacked} pairs stacked)" if fp8 else "", len(model.mtp_weights), device_bytes(model) / 1e9)
    return model.eval()


def _text_weights(model_dir: str | Path, block: tuple[int, int], device: torch.device, keep_mxfp4: bool,
                  fp8: set[str], shard=None):
    """(official name, float tensor; packed experts with keep_mxfp4, e4m3 + scale for the names in
    `fp8`) of the text model and its DSpark layers; with `shard`, this rank's slices only."""
    for raw_name, raw in iter_v41_checkpoint(model_dir, block, device, keep_mxfp4,
                                             keep_fp8=(lambda n: official_name(n) in fp8) if fp8 else None,
                                             shard=shard):
        if raw_name.startswith(_NOT_TEXT):
            continue
        read_whole = shard is not None and official_name(raw_name) is None  # transformers' fused experts
        for name, tensor in to_official(raw_name, raw):
            if read_whole:
                tensor = slice_loaded(tensor, shard(name))
                if tensor is None:
                    continue
            # an Engram table's scale: the float table has it folded in already
            if name.startswith("mtp.") or not name.endswith("engram.embed.scale"):
                yield name, tensor
