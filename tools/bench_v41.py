"""DeepSeek-V4.1 on one GPU (a script, not a test): TTFT with decoder-side bounded replay off and
on, decode steps with CUDA graphs and eagerly against their memory floor, and the graphed
greedy tokens against the eager ones. Prints tables, writes JSON.

    python -m tools.bench_v41 [--model DIR | --preset v41-flash-shaped] [--quant fp8-fp4|bf16]
        [--lengths 1024,8192,32768] [--reps 2] [--batches 1,32] [--json out.json]

The checkpoint (random weights, the released V4.1-Flash per-layer shapes and 40-layer schedule,
8 experts) is drawn on the GPU and written once under --cache-dir. One engine serves every
measurement: decode steps replay the CUDA graphs it captured per batch size (prefill chunks run
eagerly: V4.1 has no mixed-step graphs), and for the eager figures its graphs are set aside.
Decoder replay is switched per run (the `swa_decoder_replay` engine argument sets the same flag
at start). Prefix caching is off: every prompt is a cold prefill. Prompts longer than 8192 tokens
are timed once per setting (--reps for the others).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from engine.llm_engine import LLMEngine
from engine.random_checkpoint_v41 import PRESETS, write_v41_checkpoint
from engine.request import GenerationRequest, SamplingParams
from tools.bench_engine import copy_bandwidth, random_prompts, steady_step_ms


def ttft_s(engine: LLMEngine, rid: str, ids: list[int]) -> float:
    engine.add_request(GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True)))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


class eager_steps:
    """Within: the engine's decode steps run eagerly (its captured graphs set aside). padded: on
    the graphs' static batches, padded as a replay's (tells a capture fault from padding's rounding)."""

    def __init__(self, engine: LLMEngine, padded: bool = False):
        self.runner, self.padded = engine.runner, padded

    def __enter__(self):
        self.graphs, self.runner.graphs = self.runner.graphs, {}
        if self.padded:
            self.runner.static_decode_batches(sorted(self.graphs))

    def __exit__(self, *exc):
        self.runner.graphs = self.graphs


def floor_bytes(engine: LLMEngine, batch: int) -> float:
    """Bytes a decode step of `batch` rows must read: every weight but the routed experts no row
    picks (expected, uniform routing) and the gathered tables."""
    model, cfg = engine.model, engine.cfg
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts_w" in n)
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts_w" not in n and not n.startswith("embed") and ".engram.embed" not in n)
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
    return other + experts * touched


def greedy_streams(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {f"check-{i}": [] for i in range(len(prompts))}
    for rid, ids in zip(out, prompts):
        engine.add_request(GenerationRequest(rid, prompt_token_ids=ids, sampling=sp))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="v41-flash-shaped", choices=sorted(PRESETS))
    ap.add_argument("--quant", default="fp8-fp4", choices=("bf16", "fp8-fp4"))
    ap.add_argument("--cache-dir", default="/tmp/ckpt")
    ap.add_argument("--lengths", default="1024,8192,32768", help="TTFT prompt lengths ('' for none)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batches", default="1,32", help="decode batch sizes")
    ap.add_argument("--decode-input-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=48, help="graphed steps timed per batch")
    ap.add_argument("--eager-steps", type=int, default=8, help="eager steps timed per batch (each ~0.25 s)")
    ap.add_argument("--check-tokens", type=int, default=24, help="greedy tokens of 3 prompts, graphs vs eager (0: skip)")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and a.preset != "v41-tiny":
        raise SystemExit("bench_v41 measures on a GPU; none here (CUDA unavailable). On a CPU only "
                         "--preset v41-tiny runs (a smoke test of this script)")
    lengths = [int(x) for x in a.lengths.split(",") if x]
    batches = [int(x) for x in a.batches.split(",") if x]
    model = Path(a.model) if a.model else Path(a.cache_dir) / f"{a.preset}-{a.quant}"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        write_v41_checkpoint(model, a.preset, seed=0, device="cuda" if cuda else "cpu", quant=a.quant)
        print(f"wrote {model} in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    args = {"model": str(model), "max_model_len": max(lengths + [a.decode_input_len + 512]) + 256,
            "max_num_seqs": max(batches + [4]), "block_size": 128, "max_num_batched_tokens": 8192,
            "kv_cache_memory_bytes": 8 << 30, "enable_prefix_caching": False, **json.loads(a.engine_args)}
    capture_error = None
    try:
        engine = LLMEngine(args)
    except Exception as e:  # a failed capture: still measure (eagerly), and say why
        capture_error = f"{type(e).__name__}: {e}"[:2000]
    if capture_error is not None:
        print(f"engine start with CUDA graphs FAILED ({capture_error}); measuring with enforce_eager", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        engine = LLMEngine({**args, "enforce_eager": True})
    print(f"engine up in {time.perf_counter() - t:.0f} s; decode CUDA graphs for batch sizes "
          f"{sorted(engine.runner.graphs) or 'none'} (prefill chunks run eagerly)", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    if lengths:
        print("prompt | decoder replay off ms | on ms | speedup", flush=True)
    for L in lengths:
        ids = torch.randint(5, engine.cfg.vocab_size, (L,), generator=g).tolist()
        reps = a.reps if L <= 8192 else 1
        out = {}
        for on in (False, True):
            engine.model.decoder_replay = on
            ttft_s(engine, f"warm-{L}-{on}", ids[: min(L, 512)])
            out[on] = [ttft_s(engine, f"{L}-{on}-{i}", ids) * 1e3 for i in range(reps)]
        off_ms, on_ms = statistics.median(out[False]), statistics.median(out[True])
        rows.append({"prompt_tokens": L, "ttft_ms_replay_off": out[False], "ttft_ms_replay_on": out[True],
                     "speedup": off_ms / on_ms})
        print(f"{L} | {off_ms:.1f} | {on_ms:.1f} | {off_ms / on_ms:.2f}x", flush=True)
    engine.model.decoder_replay = True
    bw = copy_bandwidth() if cuda else float("nan")
    decode = []
    print(f"decode ({a.decode_input_len}-token prompts) | graphs ms/step | eager ms/step | floor ms (GB) | "
          "graphs / floor", flush=True)
    for b in batches:
        graphed = steady_step_ms(engine, b, a.decode_input_len, a.decode_steps) if engine.runner.graphs else None
        with eager_steps(engine):
            eager = steady_step_ms(engine, b, a.decode_input_len, a.eager_steps)
        need = floor_bytes(engine, b)
        floor = need / bw * 1e3
        decode.append({"batch": b, "graphs_ms_per_step": graphed, "eager_ms_per_step": eager, "floor_ms": floor,
                       "floor_bytes": need, "copy_TB_s": bw / 1e12})
        shown = "not captured" if graphed is None else f"{graphed:.2f}"
        ratio = "-" if graphed is None else f"{graphed / floor:.1f}x"
        print(f"batch {b} | {shown} | {eager:.2f} | {floor:.2f} ({need / 1e9:.1f}) | {ratio}", flush=True)
    check = None
    if a.check_tokens and engine.runner.graphs:  # 3 prompts: padded to the 4-row graph
        prompts = random_prompts(3, 300, engine.cfg.vocab_size, seed=7)
        graphed = greedy_streams(engine, prompts, a.check_tokens)
        check = {"prompts": 3, "tokens": a.check_tokens}
        for padded in (True, False):
            with eager_steps(engine, padded):
                eager = greedy_streams(engine, prompts, a.check_tokens)
            agree = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(graphed, eager)]
            name = "padded_eager" if padded else "eager"
            check[name] = {"identical_streams": sum(p == q for p, q in zip(graphed, eager)),
                           "tokens_before_first_difference": agree}
            print(f"greedy, graphs vs {name.replace('_', ' ')}: {check[name]['identical_streams']}/3 streams identical "
                  f"over {a.check_tokens} tokens (tokens before the first difference: {agree})", flush=True)
    result = {"model": str(model), "quant": a.quant, "engine_args": args, "ttft": rows, "decode": decode,
              "graphs_vs_eager": check, "graph_sizes": sorted(engine.runner.graphs), "capture_error": capture_error,
              "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
