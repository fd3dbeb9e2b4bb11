"""DeepSeek-V4.1 on one GPU (a script, not a test): TTFT with decoder trim off and
on, the prefill through CUDA graphs and eagerly; decode steps with CUDA graphs and eagerly against
their memory floor; the graphed greedy tokens against the eager ones, for decode steps and for
mixed prefill + decode steps. Prints tables, writes JSON.

    python -m tools.bench_deepseek_v41 [--model DIR | --preset v41-flash-shaped] [--quant fp8-fp4|bf16]
        [--lengths 1024,8192,32768] [--reps 2] [--batches 1,32] [--json out.json]

The checkpoint (random weights, the released V4.1-Flash per-layer shapes and 40-layer schedule,
8 experts) is drawn on the GPU and written once under --cache-dir. One engine serves every
measurement: decode steps replay the CUDA graphs it captured per batch size, mixed steps (prefill
chunks with or without decodes) the graphs it captured per token count (engine/graphs/mixed.py;
where the engine captured none, the mixed-step check captures the sizes it needs here), and for
the eager figures its graphs are set aside. The TTFT graphs are the engine's own, at its serving
max_num_seqs (64 unless --engine-args says otherwise): with decoder trim on, a front graph per
token count and a tail graph per kept-row bucket (engine/models/deepseek_v41/split_graphs.py), so a chunk's later
layers run its last window only; the other setting's graphs (a graph bakes decoder trim's
setting in) are captured here at the same max_num_seqs, only for the chunk sizes the prompts need.
Prefix caching is off: every prompt is a cold prefill. Prompts longer than 8192 tokens are timed once per setting (--reps for the others).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v41.random_checkpoint import PRESETS, write_v41_checkpoint
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


class mixed_steps:
    """Within: the engine's mixed steps run on `steps` (a MixedStepGraphs; None: eagerly, unpadded)."""

    def __init__(self, engine: LLMEngine, steps: MixedStepGraphs | None):
        self.runner, self.steps = engine.runner, steps

    def __enter__(self):
        self.saved, self.runner.mixed = self.runner.mixed, self.steps

    def __exit__(self, *exc):
        self.runner.mixed = self.saved


def prefill_graphs(engine: LLMEngine, lengths: list[int], warm: int) -> MixedStepGraphs:
    """Mixed-step graphs at the engine's max_num_seqs, at the sizes a cold prefill of each length (and
    the warm-up prompt) pads its chunks to, captured with the model's decoder_trim as it is now."""
    budget = engine.args.max_num_batched_tokens
    sizes, chunks = mixed_sizes(budget), {warm} | {min(L, budget) for L in lengths} | {L % budget for L in lengths}
    need = sorted({min(s for s in sizes if s >= c) for c in chunks if c})
    return MixedStepGraphs(engine.model, engine.cache, engine.max_model_len, engine.args.max_num_seqs, need,
                      torch.cuda.graph_pool_handle())


def tail_steps(steps: MixedStepGraphs | None) -> dict:
    """'front size/tail bucket' -> steps run so far (V4.1's split step; {} without one)."""
    split = steps.split if steps is not None else None
    return {f"{size}/{K}": n for (size, K), n in sorted(split.steps.items())} if split is not None else {}


def staggered_streams(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy streams with one prompt added per step: each prefill shares its step with the decodes
    of the prompts before it (mixed steps)."""
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    waiting = list(enumerate(prompts))
    while waiting or engine.has_unfinished():
        if waiting:
            i, ids = waiting.pop(0)
            out[f"mixed-{i}"] = []
            engine.add_request(GenerationRequest(f"mixed-{i}", prompt_token_ids=ids, sampling=sp))
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return list(out.values())


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]


def _weights(model) -> list[tuple[str, torch.Tensor]]:
    """Parameters and the stored formats' scales (FP8 tiles, MXFP4 groups: buffers), as the model holds them."""
    scales = [(n, b) for n, b in model.named_buffers() if b is not None and n.endswith("scale")]
    return list(model.named_parameters()) + scales


def floor_bytes(engine: LLMEngine, batch: int) -> float:
    """Bytes a decode step of `batch` rows must read: every weight (FP8 linears and MXFP4 experts as
    stored, with their scales) but the routed experts no row picks (expected, uniform routing) and the
    gathered tables."""
    model, cfg = engine.model, engine.cfg
    experts = sum(p.numel() * p.element_size() for n, p in _weights(model) if ".experts_w" in n)
    other = sum(p.numel() * p.element_size() for n, p in _weights(model)
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
        raise SystemExit("bench_deepseek_v41 measures on a GPU; none here (CUDA unavailable). On a CPU only "
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
            "max_num_seqs": max(batches + [64]), "block_size": 128, "max_num_batched_tokens": 8192,
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
    mixed = engine.runner.mixed
    counts = {"decode": len(engine.runner.graphs), "mixed": mixed.num_graphs() if mixed is not None else 0,
              "mixed_tail": mixed.split.num_graphs() if mixed is not None and mixed.split is not None else 0}
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in engine.model.parameters())
    weight_bytes = sum(t.numel() * t.element_size() for _, t in _weights(engine.model))
    print(f"weights {weight_bytes / 1e9:.2f} GB ({fp8} FP8 linears as stored)", flush=True)
    print(f"engine up in {time.perf_counter() - t:.0f} s (max_num_seqs {engine.args.max_num_seqs}); decode CUDA graphs "
          f"for batch sizes {sorted(engine.runner.graphs) or 'none'}; mixed-step graphs for token counts "
          f"{mixed.sizes if mixed is not None and counts['mixed'] else 'none'}; graphs captured {counts} (mixed: "
          f"fronts + tails where decoder trim splits the step)", flush=True)
    g = torch.Generator().manual_seed(0)
    rows, started_replay = [], engine.model.decoder_trim
    prompts = {L: torch.randint(5, engine.cfg.vocab_size, (L,), generator=g).tolist() for L in lengths}
    ttft = {}  # (graphs, decoder trim, prompt tokens) -> [ms]
    tails = {}  # (decoder trim, prompt tokens) -> the timed prefills' 'front size/tail bucket' steps
    graphs_on = cuda and bool(engine.runner.graphs)  # CUDA graphs enabled (mixed-step ones built here if need be)
    for graphs in ((False, True) if graphs_on else (False,)):
        for on in (False, True):
            engine.model.decoder_trim = on  # before a capture: a graph bakes it in
            own = graphs and mixed is not None and on == started_replay  # the engine's own graphs
            steps = (mixed if own else prefill_graphs(engine, lengths, 512)) if graphs else None
            with mixed_steps(engine, steps):
                for L, ids in prompts.items():
                    ttft_s(engine, f"warm-{L}-{graphs}-{on}", ids[: min(L, 512)])
                    reps = a.reps if L <= 8192 else 1
                    before = tail_steps(steps)
                    ttft[graphs, on, L] = [ttft_s(engine, f"{L}-{graphs}-{on}-{i}", ids) * 1e3 for i in range(reps)]
                    if graphs:
                        tails[on, L] = {k: v - before.get(k, 0) for k, v in tail_steps(steps).items()
                                        if v > before.get(k, 0)}
                    how = "graphs (the engine's own)" if own else "graphs" if graphs else "eager"
                    print(f"  TTFT {L} tokens, {how}, decoder trim {'on' if on else 'off'}: "
                          f"{statistics.median(ttft[graphs, on, L]):.1f} ms"
                          f"{' front/tail steps ' + str(tails[on, L]) if tails.get((on, L)) else ''}", flush=True)
            if not own:
                del steps
                gc.collect()
                torch.cuda.empty_cache()
    engine.model.decoder_trim = started_replay  # what the engine's own graphs were captured with
    if lengths:
        print("prompt | eager: replay off ms | on ms | speedup | graphs: replay off ms | on ms | speedup | "
              "graphs+replay vs eager without", flush=True)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    for L in lengths:
        row = {"prompt_tokens": L, "ttft_ms_eager_replay_off": ttft[False, False, L],
               "ttft_ms_eager_replay_on": ttft[False, True, L],
               "speedup_eager": med[False, False, L] / med[False, True, L]}
        shown = f"{L} | {med[False, False, L]:.1f} | {med[False, True, L]:.1f} | {row['speedup_eager']:.2f}x"
        if (True, True, L) in med:
            row.update({"ttft_ms_graphs_replay_off": ttft[True, False, L], "ttft_ms_graphs_replay_on": ttft[True, True, L],
                        "graphs_replay_on_front_tail_steps": tails.get((True, L), {}),
                        "speedup_graphs": med[True, False, L] / med[True, True, L],
                        "graphs_replay_on_vs_eager_replay_off": med[False, False, L] / med[True, True, L]})
            shown += (f" | {med[True, False, L]:.1f} | {med[True, True, L]:.1f} | {row['speedup_graphs']:.2f}x | "
                      f"{row['graphs_replay_on_vs_eager_replay_off']:.2f}x")
        else:
            shown += " | no mixed-step graphs"
        rows.append(row)
        print(shown, flush=True)
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
    mixed_check = None
    if a.check_tokens and graphs_on:  # prompts longer than the window: decoder trim drops rows
        prompts = random_prompts(3, 300, engine.cfg.vocab_size, seed=8)
        own = mixed if mixed is not None else MixedStepGraphs(  # the engine's graphs, or the sizes these steps need
            engine.model, engine.cache, engine.max_model_len, engine.args.max_num_seqs,
            [s for s in mixed_sizes(engine.args.max_num_batched_tokens) if s <= 1024], torch.cuda.graph_pool_handle())
        before = own.replays
        with mixed_steps(engine, own):
            graphed = staggered_streams(engine, prompts, a.check_tokens)
        mixed_check = {"prompts": 3, "tokens": a.check_tokens, "decoder_trim": engine.model.decoder_trim,
                       "mixed_graph_replays": own.replays - before, "engine_captured": mixed is not None}
        padded = MixedStepGraphs(engine.model, engine.cache, engine.max_model_len, engine.args.max_num_seqs, own.sizes)
        for name, steps in (("padded_eager", padded), ("eager", None)):
            with mixed_steps(engine, steps):
                other = staggered_streams(engine, prompts, a.check_tokens)
            agree = first_differences(graphed, other)
            mixed_check[name] = {"identical_streams": sum(p == q for p, q in zip(graphed, other)),
                                 "tokens_before_first_difference": agree}
            print(f"greedy with mixed steps ({mixed_check['mixed_graph_replays']} replayed), graphs vs "
                  f"{name.replace('_', ' ')}: {mixed_check[name]['identical_streams']}/3 streams identical over "
                  f"{a.check_tokens} tokens (tokens before the first difference: {agree})", flush=True)
    result = {"model": str(model), "quant": a.quant, "engine_args": args, "weight_bytes": weight_bytes,
              "fp8_linears_as_stored": fp8, "ttft": rows, "decode": decode,
              "graphs_vs_eager": check, "mixed_graphs_vs_eager": mixed_check, "graph_sizes": sorted(engine.runner.graphs),
              "mixed_graph_sizes": mixed.sizes if mixed is not None else [], "graphs_captured": counts,
              "capture_error": capture_error,
              "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
