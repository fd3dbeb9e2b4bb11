"""One tensor-parallel rank's share of DeepSeek-V4-Flash as shipped, timed on one GPU (a script, not
a test): what a rank computes per decode step and per prefill chunk at tensor_parallel_size N, plus
the bytes each collective moves per step (computed). docs/PERF.md projects multi-GPU step times
from these.

    python -m tools.bench_tp_share [--world 8] [--preset flash-depth] [--experts 256] \
        [--batches 1,32,150] [--input-len 512] [--chunk 2048] [--json out.json]

The share is rank 0's (engine/parallel.py with enable_expert_parallel): num_heads / N heads,
o_groups / N output groups, experts / N routed experts in MXFP4, the shared expert's 1/N slice,
the replicated latent / compressors / indexer / router, and the LM head. It is built in memory with
random weights in the stored formats (no checkpoint on disk: the whole model would not fit it)
and run by the real engine (scheduler, runner, CUDA graphs) with the collectives skipped
(TensorParallel.share_only): the compute a rank does between its all-reduces. The router routes
top-k over all experts and this rank computes only the pairs that land on its own, as it would.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import engine.models.registry as registry
from engine.llm import LLM
from engine.models.deepseek_v4.config import parse_config
from engine.models.deepseek_v4.model import DeepseekV4
from engine.models.deepseek_v4.random_checkpoint import PRESETS, build_config, write_tokenizer
from engine.models.stacked_linears import stack_linears
from engine.parallel import TensorParallel, check_parallel
from engine.request import GenerationRequest, SamplingParams
from tools.bench_engine import random_prompts, steady_decode

ALLREDUCES_PER_LAYER = 2  # attention output (wo_b partial sums) and MoE output (routed + shared)


@torch.no_grad()
def random_share(cfg, tp: TensorParallel, device: str, dtype: torch.dtype) -> DeepseekV4:
    """Rank `tp.rank`'s modules, weights drawn in place in their stored formats, O(1) activations."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, quantized=device != "cpu", tp=tp)
    model.to_empty(device=device)
    model.cast(dtype)
    fill_random(model, cfg, device)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    stack_linears(model)  # as the loader does: linears reading one input in one launch
    return model.eval()


@torch.no_grad()
def fill_random(model, cfg, device: str) -> None:
    """Every parameter and buffer of a V4 or V4.1 share drawn in place in its stored format."""
    g = torch.Generator(device=device).manual_seed(0)
    for name, t in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b is not None)]:
        if t.dtype == torch.float8_e4m3fn:
            t.copy_(torch.randn(t.shape, generator=g, device=device).mul_(0.5).to(t.dtype))
        elif t.dtype == torch.int8:  # packed e2m1 pairs
            t.copy_(torch.randint(-128, 128, t.shape, generator=g, device=device, dtype=torch.int16).to(torch.int8))
        elif t.dtype == torch.uint8:  # ue8m0 MXFP4 scales: 2^-7, weights ~ 1/sqrt(K)
            t.fill_(120)
        elif name.endswith("tid2eid"):
            t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g, device=device))
        elif name.endswith(".scale") or name.endswith("_scale") and t.dtype == torch.float32 and t.dim() >= 2:
            t.fill_(1.0 / 64)  # FP8 block scales
        elif "norm" in name or name.endswith("hc_attn_scale") or name.endswith("hc_ffn_scale") or "hc_head_scale" in name:
            t.fill_(1.0)
        elif name.startswith("layers.") and (".hc_" in name or "attn_sink" in name or ".ape" in name or "bias" in name):
            t.zero_()
        elif t.is_floating_point():
            fan_in = t.shape[-1] if t.dim() > 1 else 1
            t.copy_(torch.randn(t.shape, generator=g, device=device).mul_(fan_in**-0.5).to(t.dtype))


def share_model(preset: str, experts: int, quant: str, world: int, device: str):
    """Rank 0's share at tensor_parallel_size `world` (collectives skipped), built in memory, and a model
    folder (config, tokenizer) whose load by an engine made after this call returns that share:
    (folder, model, cfg, tp). The CPU runs bf16 whatever `quant` says."""
    raw = build_config(preset, {"n_routed_experts": experts}, quant if device == "cuda" else "bf16")
    cfg = parse_config(raw)
    tp = TensorParallel(0, world, expert_parallel=True, share_only=True)
    check_parallel(cfg, world, True)
    model = random_share(cfg, tp, device, torch.bfloat16)
    folder = Path(tempfile.mkdtemp(prefix="tp-share-"))
    (folder / "config.json").write_text(json.dumps(raw))
    write_tokenizer(folder)
    registry.load_model = lambda *args, **kw: model  # the engine runs the share built above
    return folder, model, cfg, tp


def share_floor(model: DeepseekV4, cfg, tp: TensorParallel, batch: int, copy_bytes_per_s: float) -> dict:
    """A decode step's floor on this rank: the weights it reads (share_bytes) over the copy bandwidth."""
    read = share_bytes(model, cfg, tp, batch)["weights_read"]
    return {"batch": batch, "weight_bytes": read, "copy_TB_s": copy_bytes_per_s / 1e12,
            "floor_ms": read / copy_bytes_per_s * 1e3}


def share_bytes(model: DeepseekV4, cfg, tp: TensorParallel, batch: int) -> dict:
    """Weight bytes a decode step of `batch` tokens reads on this rank: everything but the routed
    experts and the embedding, plus the expected number of its experts the batch hits."""
    def nbytes(pred):
        return sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                   if t is not None and pred(n))
    experts = nbytes(lambda n: ".experts_w" in n)
    replicated = nbytes(lambda n: any(k in n for k in (".compressor.", ".indexer.", ".wq_a.", ".wkv.", ".gate.")))
    other = nbytes(lambda n: ".experts_w" not in n and not n.startswith("embed"))
    local = tp.local_experts(cfg)
    # a token's top-k are k distinct experts of E: P(a given expert is missed by the batch)
    hit = local * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)
    return {"weights_other": other, "weights_replicated": replicated, "experts_hit": hit,
            "weights_experts_read": experts * hit / local, "weights_read": other + experts * hit / local}


def collective_bytes(cfg, world: int, tokens: int, act_bytes: int = 2) -> dict:
    """Per step: 2 all-reduces per layer of [tokens, hidden] activations, one broadcast of the ids.
    A ring all-reduce sends (and receives) 2 (N-1)/N of the buffer per GPU."""
    buf = tokens * cfg.hidden_size * act_bytes
    n = ALLREDUCES_PER_LAYER * cfg.num_layers
    return {"allreduces_per_step": n, "allreduce_buffer_bytes": buf,
            "allreduce_bytes_per_gpu_per_step": n * buf * 2 * (world - 1) / world,
            "broadcast_bytes_per_step": tokens * 8}


def time_prefill_chunk(engine, chunk: int, repeats: int = 3) -> float:
    """Wall time of one `chunk`-token prefill step (a fresh request each time, nothing cached)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i, prompt in enumerate(random_prompts(repeats + 1, chunk + 1, engine.cfg.vocab_size, seed=99)):
        engine.add_request(GenerationRequest(f"chunk-{i}", prompt_token_ids=prompt,
                                             sampling=SamplingParams(max_tokens=1, temperature=0)))
        sync()
        t = time.perf_counter()
        engine.step()  # the first `chunk` tokens (max_num_batched_tokens = chunk)
        sync()
        times.append(time.perf_counter() - t)
        engine.abort(f"chunk-{i}")
        engine.flush()
    return sorted(times[1:])[len(times[1:]) // 2] * 1e3  # the first one compiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8, help="tensor_parallel_size N whose rank 0 share is timed")
    ap.add_argument("--preset", default="flash-depth", choices=sorted(PRESETS))
    ap.add_argument("--experts", type=int, default=256, help="routed experts of the whole model")
    ap.add_argument("--quant", default="fp8-fp4", help="the stored formats (on CUDA; the CPU runs bf16)")
    ap.add_argument("--batches", default="1,32,150")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp, model, cfg, tp = share_model(a.preset, a.experts, a.quant, a.world, device)
    batches = [int(b) for b in a.batches.split(",")]
    max_len = a.input_len + a.steps + 64
    engine_args = {"model": str(tmp), "max_model_len": max(max_len, a.chunk + 8), "max_num_seqs": max(batches) + 8,
                   "max_num_batched_tokens": a.chunk, "block_size": 128, "gpu_memory_utilization": 0.9}
    t0 = time.perf_counter()
    if device == "cuda":  # the KV pools: enough for the batches, the same for both engines made here
        engine_args["kv_cache_memory_bytes"] = 16 << 30
    decode = steady_decode(engine_args, batches, a.input_len, a.steps)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    # prefill steps are eager: an engine without graphs, a small batch
    chunk_ms = time_prefill_chunk(LLM(**{**engine_args, "enforce_eager": True, "max_num_seqs": 4}).engine, a.chunk)
    rows = []
    for d in decode:
        b = d["batch"]
        rows.append({**d, **share_bytes(model, cfg, tp, b), **collective_bytes(cfg, a.world, b)})
    prefill = {"chunk_tokens": a.chunk, "step_ms": chunk_ms, **collective_bytes(cfg, a.world, a.chunk)}
    print(f"\none rank's share at tensor_parallel_size={a.world} ({cfg.num_layers} layers, "
          f"{tp.local_heads(cfg)}/{cfg.num_heads} heads, {tp.local_experts(cfg)}/{cfg.n_routed_experts} experts, "
          f"{a.quant if device == 'cuda' else 'bf16'}) on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"{'batch':>6} {'ms/step':>8} {'GB read':>8} {'experts hit':>11} {'allreduce KB':>12} {'AR MB/GPU/step':>14}")
    for r in rows:
        print(f"{r['batch']:>6} {r['step_ms']:>8.2f} {r['weights_read'] / 1e9:>8.2f} {r['experts_hit']:>11.1f} "
              f"{r['allreduce_buffer_bytes'] / 1e3:>12.1f} {r['allreduce_bytes_per_gpu_per_step'] / 1e6:>14.2f}")
    print(f"prefill chunk of {a.chunk}: {chunk_ms:.2f} ms, all-reduce buffer {prefill['allreduce_buffer_bytes'] / 1e6:.1f} MB "
          f"x {prefill['allreduces_per_step']}; {time.perf_counter() - t0:.0f} s in all")
    if a.json:
        out = {"world": a.world, "preset": a.preset, "experts": a.experts, "quant": a.quant, "device": device,
               "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
               "decode": rows, "prefill": prefill, "layers": cfg.num_layers, "hidden": cfg.hidden_size}
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
