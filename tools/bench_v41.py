"""DeepSeek-V4.1 on one GPU (a script, not a test): TTFT with decoder-side bounded replay off and
on, and the batch-1 decode step against its memory floor. Prints a table, writes JSON.

    python -m tools.bench_v41 [--model DIR | --preset v41-flash-shaped] [--quant fp8-fp4|bf16]
        [--lengths 1024,8192,32768] [--reps 2] [--json out.json]

The checkpoint (random weights, the released V4.1-Flash per-layer shapes and 40-layer schedule,
8 experts) is drawn on the GPU and written once under --cache-dir. One engine serves every
measurement; decoder replay is switched per run (the `swa_decoder_replay` engine argument sets
the same flag at start). Prefix caching is off: every prompt is a cold prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.llm_engine import LLMEngine
from engine.random_checkpoint_v41 import PRESETS, write_v41_checkpoint
from engine.request import GenerationRequest, SamplingParams


def ttft_s(engine: LLMEngine, rid: str, ids: list[int]) -> float:
    engine.add_request(GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True)))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def decode_ms(engine: LLMEngine, ids: list[int], steps: int) -> float:
    """Mean wall time of a batch-1 decode step (after the prefill)."""
    engine.add_request(GenerationRequest("decode", prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=steps + 4, temperature=0, ignore_eos=True)))
    for _ in range(5):  # the prefill, then a few steps before timing
        engine.step()
    t, n = time.perf_counter(), 0
    while engine.has_unfinished() and n < steps:
        engine.step()
        n += 1
    elapsed = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return elapsed / max(n, 1) * 1e3


def floor_ms(engine: LLMEngine) -> tuple[float, float]:
    """(bytes a batch-1 decode step must read: every weight but the routed experts a token skips
    and the gathered tables, ms at the measured copy bandwidth)."""
    model, cfg = engine.model, engine.cfg
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts_w" in n)
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts_w" not in n and not n.startswith("embed") and ".engram.embed" not in n)
    need = other + experts * min(1.0, cfg.num_experts_per_tok / cfg.n_routed_experts)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return need, need / bw * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="v41-flash-shaped", choices=sorted(PRESETS))
    ap.add_argument("--quant", default="fp8-fp4", choices=("bf16", "fp8-fp4"))
    ap.add_argument("--cache-dir", default="/tmp/ckpt")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and a.preset != "v41-tiny":
        raise SystemExit("bench_v41 measures on a GPU; none here (CUDA unavailable). On a CPU only "
                         "--preset v41-tiny runs (a smoke test of this script)")
    lengths = [int(x) for x in a.lengths.split(",")]
    model = Path(a.model) if a.model else Path(a.cache_dir) / f"{a.preset}-{a.quant}"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        write_v41_checkpoint(model, a.preset, seed=0, device="cuda" if cuda else "cpu", quant=a.quant)
        print(f"wrote {model} in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    args = {"model": str(model), "max_model_len": max(lengths) + 256, "max_num_seqs": 4, "block_size": 128,
            "max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 8 << 30, "enable_prefix_caching": False,
            **json.loads(a.engine_args)}
    engine = LLMEngine(args)
    print(f"engine up in {time.perf_counter() - t:.0f} s (CUDA graphs: {bool(engine.runner.graphs)}; V4.1 decode "
          "runs eagerly: its compressor plan and Engram look-back are built on the host per step)", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    print("prompt | decoder replay off ms | on ms | speedup", flush=True)
    for L in lengths:
        ids = torch.randint(5, engine.cfg.vocab_size, (L,), generator=g).tolist()
        out = {}
        for on in (False, True):
            engine.model.decoder_replay = on
            ttft_s(engine, f"warm-{L}-{on}", ids[: min(L, 512)])
            out[on] = [ttft_s(engine, f"{L}-{on}-{i}", ids) * 1e3 for i in range(a.reps)]
        off_ms, on_ms = statistics.median(out[False]), statistics.median(out[True])
        rows.append({"prompt_tokens": L, "ttft_ms_replay_off": out[False], "ttft_ms_replay_on": out[True],
                     "speedup": off_ms / on_ms})
        print(f"{L} | {off_ms:.1f} | {on_ms:.1f} | {off_ms / on_ms:.2f}x", flush=True)
    engine.model.decoder_replay = True
    step = decode_ms(engine, ids[:1024], a.decode_steps)
    need, floor = floor_ms(engine) if cuda else (0, float("nan"))
    print(f"decode batch 1: {step:.2f} ms/step; floor {need / 1e9:.2f} GB -> {floor:.2f} ms ({step / floor:.1f}x)",
          flush=True)
    result = {"model": str(model), "quant": a.quant, "engine_args": args, "ttft": rows,
              "decode": {"batch": 1, "ms_per_step": step, "floor_ms": floor, "floor_bytes": need},
              "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
