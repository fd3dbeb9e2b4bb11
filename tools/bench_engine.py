"""Engine benchmark (a script, not a test): offline throughput and online TTFT / ITL through
the async API, on random or multi-turn agentic prompts. Prints a table, writes JSON.

    python -m tools.bench_engine [--model DIR | --preset tiny|flash-shaped|flash-depth] \
        [--concurrency 1,8,32] [--workload random|agentic] [--input-len 256] [--output-len 64] \
        [--requests-per-user N | --duration S [--warmup S] [--stop-timeout S]] \
        [--engine-args JSON] [--baseline] [--json out.json]

Online levels run one of two ways, named in each result's `accounting`:
- "drain" (--requests-per-user N, the default): every user sends N requests (agentic: one
  conversation); output tok/s = all output tokens / the time until the last one finished.
- "window" (--duration S): closed-loop users for S seconds, as a loadtest.sweep level
  (loadtest.engine_direct), read by loadtest.window as the sweep reads its levels: output tok/s
  counts the tokens that arrived in [start + --warmup, start + S], latencies the requests sent in
  it; in-flight requests get --stop-timeout to finish, then are cancelled. The result carries the
  window and every request's record. Compare it with a sweep of the same --duration and --warmup.

Online levels carry the load generator's saturation check (loadtest.saturation): workers idle
between requests (Little's law) and, with --core-process, this process's CPU; a client-bound
level exits 3 unless --allow-client-bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.args import EngineArgs, resolve_model_dir
from engine.core_client import CoreClient
from engine.llm import LLM, AsyncLLM
from engine.models.deepseek_v4.random_checkpoint import PRESETS, QUANTS
from engine.models.registry import load_config
from engine.request import GenerationRequest, SamplingParams
from loadtest import engine_direct, saturation, window

BASELINE = {"kernels": "ref", "enforce_eager": True, "enable_prefix_caching": False, "async_scheduling": False}


@dataclass
class Result:
    mode: str
    workload: str
    concurrency: int
    requests: int
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    deltas: int = 0  # streamed deltas with tokens: below output_tokens when a slow consumer got them merged
    saturation: dict = field(default_factory=dict)  # online: was this process the limit (loadtest.saturation)
    accounting: str = "drain"  # online: "drain" (--requests-per-user) or "window" (--duration; see the docstring)
    window: dict = field(default_factory=dict)  # "window": its settings and loadtest.window's rates
    records: list[dict] = field(default_factory=list)  # "window": every request, as the sweep records them

    @property
    def output_tok_s(self) -> float:
        if self.accounting == "window":
            return self.window["output_tok_per_s"]
        return self.output_tokens / self.duration_s if self.duration_s else 0.0


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(xs)}


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n, input_len), generator=g).tolist()


def agentic_conversations(n_conv: int, turns: int, system_len: int, turn_len: int, vocab: int, seed: int):
    """Per conversation: a list of turn prompts; turn t's prompt is the shared system prompt, the
    whole conversation so far (earlier prompts and stand-in replies) and new text."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(5, vocab, (system_len,), generator=g).tolist()
    return [conversation(g, system, turns, turn_len, vocab) for _ in range(n_conv)]


def conversation(g: torch.Generator, system: list[int], turns: int, turn_len: int, vocab: int) -> list[list[int]]:
    history, prompts = list(system), []
    for _ in range(turns):
        history = history + torch.randint(5, vocab, (turn_len,), generator=g).tolist()
        prompts.append(list(history))
        history = history + torch.randint(5, vocab, (turn_len // 2,), generator=g).tolist()  # the reply
    return prompts


def user_prompts(args, vocab: int, level: int, user: int) -> Iterator[list[int]]:
    """--duration mode: one user's endless prompts, its own draws (seeded by level and user); agentic:
    conversation after conversation over the level's shared system prompt."""
    g = torch.Generator().manual_seed(level * 100_003 + user + 1)
    if args.workload == "agentic":
        system = torch.randint(5, vocab, (args.input_len,), generator=torch.Generator().manual_seed(level)).tolist()
        while True:
            yield from conversation(g, system, args.turns, args.turn_len, vocab)
    while True:
        yield torch.randint(5, vocab, (args.input_len,), generator=g).tolist()


def offline(llm: LLM, prompts: list[list[int]], output_len: int) -> Result:
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    return Result("offline", "random", len(prompts), len(prompts), dt, sum(len(o.token_ids) for o in outs),
                  sum(len(p) for p in prompts))


async def _one(engine: AsyncLLM, rid: str, prompt: list[int], output_len: int, rec: dict) -> None:
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    last, first = t0, None
    async for out in engine.add(GenerationRequest(rid, prompt_token_ids=prompt, sampling=sp)):
        now = time.perf_counter()
        if out.token_ids:
            rec["deltas"] += 1
            if first is None:
                first = now
                rec["ttft"].append((now - t0) * 1e3)
            else:
                rec["itl"].append((now - last) * 1e3 / len(out.token_ids))
            last = now
        if out.finished:
            rec["out"] += out.num_output_tokens
            rec["cached"] += out.num_cached_tokens
    rec["e2e"].append((time.perf_counter() - t0) * 1e3)
    rec["prompt"] += len(prompt)


async def online(engine: AsyncLLM, workload: str, concurrency: int, jobs: list[list[list[int]]],
                 output_len: int, client_cpu: bool = False) -> Result:
    """jobs: one list of prompts per worker stream (agentic: the turns of a conversation, in order).
    client_cpu: this process is only the clients and the front (the engine core runs in its own
    process), so its CPU counts in the saturation check."""
    rec = {"ttft": [], "itl": [], "e2e": [], "out": 0, "prompt": 0, "cached": 0, "deltas": 0}
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    spans: dict[int, list[tuple[float, float]]] = {}
    drained: list[float] = []  # when each worker found the queue empty: from the first, fewer users run

    async def worker(w: int) -> None:
        while not queue.empty():
            for t, prompt in enumerate(queue.get_nowait()):
                begin = time.perf_counter()
                await _one(engine, f"{workload}-{concurrency}-{w}-{id(prompt)}-{t}", prompt, output_len, rec)
                spans.setdefault(w, []).append((begin, time.perf_counter()))
        drained.append(time.perf_counter())

    t, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    dt, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    busy = saturation.users_busy(spans, min(drained, default=t), t)
    e2e_s = statistics.fmean(rec["e2e"]) / 1e3 if rec["e2e"] else None
    procs = [saturation.ProcessCpu(os.getpid(), cpu_s, dt)] if client_cpu else []
    sat = saturation.check(concurrency, e2e_s, 0.0, len(rec["e2e"]) / dt, busy["busy_ratio"], procs)
    return Result("online", workload, concurrency, len(rec["e2e"]), dt, rec["out"], rec["prompt"], rec["cached"],
                  _pct(rec["ttft"]), _pct(rec["itl"]), _pct(rec["e2e"]), rec["deltas"], sat)


async def windowed(engine, args, concurrency: int, vocab: int) -> Result:
    """One --duration level: closed-loop users (loadtest.engine_direct) read with loadtest.window."""
    level = await engine_direct.closed_loop(
        engine, concurrency, lambda u: user_prompts(args, vocab, concurrency, u), args.output_len, args.duration,
        args.stop_timeout, tag=f"{args.workload}-{concurrency}", client_cpu=args.core_process)
    return window_result(level, args, concurrency)


def window_result(level: engine_direct.Level, args, concurrency: int) -> Result:
    """A --duration level's Result: its rates and latencies as loadtest.sweep's summarize counts them."""
    reqs, marks = level.requests, level.marks
    span = window.window_of(reqs, marks, args.warmup)
    inside = window.figures(reqs, span)
    ok = [r for r in reqs if r["ok"]]
    settings = {"duration_s": args.duration, "warmup_s": args.warmup, "stop_timeout_s": args.stop_timeout}
    counts = {"errors": sum(1 for r in reqs if not r["ok"] and not r["cancelled"]),
              "cancelled": sum(1 for r in reqs if r["cancelled"]),
              "error_samples": sorted({r["error"] for r in reqs if r["error"]})[:5]}
    rates = {k: inside[k] for k in ("window_s", "request_per_s", "output_tok_per_s", "input_tok_per_s")}
    return Result("online", args.workload, concurrency, requests=len(ok), duration_s=marks["stop"] - marks["start"],
                  output_tokens=sum(r["server_num_output_tokens"] or 0 for r in ok),
                  prompt_tokens=sum(r["prompt_tokens"] for r in ok), cached_tokens=level.cached_tokens,
                  ttft_ms=inside["ttft_ms"], itl_ms=inside["itl_ms"], e2e_ms=inside["e2e_ms"],
                  deltas=sum(r["deltas"] for r in reqs),
                  saturation=window.client_saturation(reqs, span, concurrency, inside["request_per_s"],
                                                      marks.get("cpu", [])),
                  accounting="window", window={**settings, **rates, **counts, "tpot_ms": inside["tpot_ms"]},
                  records=[{k: v for k, v in r.items() if k not in ("delta_ms", "delta_tokens")} for r in reqs])


def counted(r: Result) -> str:
    """How a row's rates were counted (the table's "counted" column)."""
    if r.mode != "online":
        return "all"
    if r.accounting == "window":
        return window.describe(r.window["duration_s"], r.window["warmup_s"])
    return "drain"


def print_table(results: list[Result]) -> None:
    cols = ["mode", "counted", "workload", "conc", "reqs", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms",
            "E2E p50 ms", "cached %", "client"]
    rows = [[r.mode, counted(r), r.workload, r.concurrency, r.requests, f"{r.output_tok_s:.1f}",
             f"{r.ttft_ms.get('p50', 0):.1f}", f"{r.ttft_ms.get('p90', 0):.1f}", f"{r.itl_ms.get('p50', 0):.2f}",
             f"{r.e2e_ms.get('p50', 0):.1f}", f"{100 * r.cached_tokens / max(r.prompt_tokens, 1):.0f}",
             saturation.describe(r.saturation) if r.saturation else "-"]
            for r in results]
    if not rows:
        return
    widths = [max(len(str(c)), *(len(str(row[i])) for row in rows)) for i, c in enumerate(cols)]
    print(" | ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def hf_peer(model_dir: str, batches: list[int], input_len: int, steps: int = 32) -> list[dict]:
    """transformers' eager DeepseekV4ForCausalLM on the same checkpoint: TTFT and decode ms/step."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).cuda().eval()  # load, then cast
    vocab, rows = model.config.vocab_size, []

    def timed(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for b in batches:
        ids = torch.randint(5, vocab, (b, input_len), device="cuda")
        timed(ids[:, :16], 2)  # warm-up
        prefill = timed(ids, 1)
        total = timed(ids, steps + 1)
        step_ms = (total - prefill) / steps * 1e3
        rows.append({"peer": "transformers-eager", "batch": b, "input_len": input_len, "ttft_ms": prefill * 1e3,
                     "decode_ms_per_step": step_ms, "output_tok_s": b * 1e3 / step_ms})
        print(f"  transformers eager: batch {b}: TTFT {prefill * 1e3:.1f} ms, decode {step_ms:.1f} ms/step", flush=True)
    return rows


def decode_floors(engine_args: dict, batches: list[int]) -> list[dict]:
    """Per batch: the bytes a decode step must read (active weights + KV) over the measured copy
    bandwidth. One model load for all batches (an 85 GB checkpoint loads in minutes)."""
    from engine.models.registry import load_model

    model = load_model(resolve_model_dir(engine_args.get("model", "")), "bfloat16", "cuda")
    cfg = model.cfg
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts_w" in n)
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts_w" not in n and not n.startswith("embed"))
    head = model.head.weight
    head_bytes = head.numel() * head.element_size()
    # parameters one token multiplies by (the embedding is a lookup): dense + its top-k of the experts
    expert_params = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for n, p in model.named_parameters()
                        if ".experts_w" in n)  # packed MXFP4: two values a byte
    dense_params = sum(p.numel() for n, p in model.named_parameters()
                       if ".experts_w" not in n and not n.startswith(("embed", "head")))  # the head: one row per prompt
    active_params = dense_params + expert_params * cfg.num_experts_per_tok / cfg.n_routed_experts
    head_ms = {b: _time_ms(lambda x=torch.randn(b, cfg.hidden_size, device="cuda", dtype=head.dtype), w=head:
                           torch.nn.functional.linear(x, w)) for b in batches}
    head_params = head.numel()
    del model, head
    torch.cuda.empty_cache()
    copy_bw = copy_bandwidth()
    rows = []
    for batch in batches:
        touched = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok) / cfg.n_routed_experts
        weight_bytes = other + experts * touched + batch * cfg.hidden_size * 2  # + the embedding rows read
        rows.append({"batch": batch, "weight_bytes": weight_bytes, "copy_TB_s": copy_bw / 1e12,
                     "floor_ms": weight_bytes / copy_bw * 1e3, "num_layers": cfg.num_layers,
                     "head_bytes": head_bytes, "head_floor_ms": head_bytes / copy_bw * 1e3, "head_ms": head_ms[batch],
                     "active_params_per_token": active_params, "head_params": head_params})
    return rows


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write): what a memory-bound step can reach."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


PEAK_BF16_FLOPS = 790e12  # the H200's bf16 matmul peak (measured 777-803 TFLOP/s, docs/PERF.md)


def prefill_flops(cfg, active_params: float, n: int, head_params: int = 0) -> float:
    """FLOPs of prefilling an n-token prompt: 2 per active parameter per token (the LM head once), plus attention
    (every query against its window and its compressed entries: the CSA top-k, all HCA entries)
    and the CSA indexer's scores, each multiply-add 2 FLOPs, K = V read twice (scores, values)."""
    from engine.models.config import CSA, SLIDING

    flops = 2.0 * active_params * n + 2.0 * head_params
    H, hd = cfg.num_heads, cfg.head_dim
    for kind, r in zip(cfg.layer_types, cfg.compress_ratios):
        for pos in range(0, n, 16):  # positions sampled every 16: the sums are smooth
            keys = min(pos + 1, cfg.sliding_window)
            if kind != SLIDING:
                seen = (pos + 1) // r
                keys += min(seen, cfg.index_topk) if kind == CSA else seen
                if kind == CSA:
                    flops += 16 * 2 * seen * cfg.index_n_heads * cfg.index_head_dim
            flops += 16 * 4 * keys * H * hd
    return flops


def ttft_vs_floor(results: list, floors: list[dict], cfg) -> list[dict]:
    """TTFT of the single-user online runs next to their prompt's FLOP floor at the bf16 peak."""
    rows = []
    for r in results:
        if r.mode == "online" and r.concurrency == 1 and r.ttft_ms and floors:
            n = r.prompt_tokens // max(r.requests, 1)
            f = floors[0]
            floor_ms = prefill_flops(cfg, f["active_params_per_token"], n, f["head_params"]) / PEAK_BF16_FLOPS * 1e3
            rows.append({"input_len": n, "ttft_p50_ms": r.ttft_ms["p50"], "floor_ms": floor_ms,
                         "x_floor": r.ttft_ms["p50"] / floor_ms})
            print(f"  TTFT of {n} tokens at 1 user: {r.ttft_ms['p50']:.1f} ms vs FLOP floor {floor_ms:.1f} ms "
                  f"({rows[-1]['x_floor']:.1f}x)", flush=True)
    return rows


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def per_layer(steady: list[dict], floors: list[dict]) -> list[dict]:
    """Per batch: the decode step and its floor per layer, the LM head taken out of both (its
    measured time from the step, its bytes from the floor), next to the whole step."""
    by_batch = {f["batch"]: f for f in floors}
    rows = []
    for s in steady:
        f = by_batch.get(s["batch"])
        if f is None:
            continue
        L = f["num_layers"]
        layer_ms, layer_floor = (s["step_ms"] - f["head_ms"]) / L, (f["floor_ms"] - f["head_floor_ms"]) / L
        rows.append({"batch": s["batch"], "step_ms": s["step_ms"], "floor_ms": f["floor_ms"],
                     "x_floor": s["step_ms"] / f["floor_ms"], "head_ms": f["head_ms"], "layer_ms": layer_ms,
                     "layer_floor_ms": layer_floor, "layer_x_floor": layer_ms / layer_floor})
        print(f"  batch {s['batch']}: step {s['step_ms']:.2f} ms ({rows[-1]['x_floor']:.1f}x floor "
              f"{f['floor_ms']:.2f}); per layer {layer_ms:.3f} ms vs {layer_floor:.3f} ms floor "
              f"({rows[-1]['layer_x_floor']:.1f}x; {L} layers, LM head {f['head_ms']:.2f} ms apart)", flush=True)
    return rows


def steady_step_ms(eng, batch: int, input_len: int, steps: int, sampling: dict | None = None) -> float:
    """Wall ms per engine step of `batch` requests decoding together, their prompts (random,
    `input_len` tokens) prefilled before the timing; the requests are aborted after. sampling: SamplingParams
    fields of every request (default greedy)."""
    sp = SamplingParams(max_tokens=steps + 16, ignore_eos=True, **{"temperature": 0, **(sampling or {})})
    for i, prompt in enumerate(random_prompts(batch, input_len, eng.cfg.vocab_size, seed=batch)):
        eng.add_request(GenerationRequest(f"steady-{batch}-{i}", prompt_token_ids=prompt, sampling=sp))
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    step_ms = (time.perf_counter() - t) / steps * 1e3
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.flush()
    return step_ms


def steady_decode(engine_args: dict, batches: list[int], input_len: int, steps: int = 64,
                  sampling: dict | None = None) -> list[dict]:
    """Decode alone, no prefill in the steps timed: `batch` requests whose prompts are prefilled
    first, then `steps` engine steps timed on the wall clock (host work, graph replay, sampler and
    the async read-back included). The figure the decode-throughput target is about."""
    llm = LLM(**engine_args)
    eng, rows = llm.engine, []
    try:
        for b in batches:
            step_ms = steady_step_ms(eng, b, input_len, steps, sampling)
            rows.append({"batch": b, "input_len": input_len, "step_ms": step_ms, "output_tok_s": b * 1e3 / step_ms,
                         "sampling": sampling or {"temperature": 0}})
            print(f"  steady decode: batch {b}: {step_ms:.2f} ms/step, {b * 1e3 / step_ms:.0f} tok/s", flush=True)
    finally:
        if eng.parallel is not None:  # one process group per process: the online engine after this one needs it
            eng.parallel.close()
    return rows


def check_graphs(engine_args: dict, n_prompts: int = 8, steps: int = 32, against: dict | None = None) -> dict:
    """Greedy tokens and logprobs of the default engine (fused kernels, CUDA graphs) vs eager, or vs
    `against` (e.g. the torch references) on the same prompts."""
    outs, paths = {}, {}
    for eager in (True, False):
        variant = (against or {"enforce_eager": True}) if eager else {}
        llm = LLM(**{**engine_args, **variant})
        vocab = llm.engine.cfg.vocab_size
        # prompts of mixed lengths: the budget splits them into chunks mixed with decodes
        prompts = [p[:100 + 97 * i] for i, p in enumerate(random_prompts(n_prompts, 100 + 97 * n_prompts, vocab, 11))]
        paths[eager] = step_paths(llm.engine.runner)
        outs[eager] = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                           logprobs=1))
        paths[eager] = {k: v - paths[eager][k] for k, v in step_paths(llm.engine.runner).items()}
        del llm
        torch.cuda.empty_cache()
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[True], outs[False]))
    diff = max(abs(la[a.token_ids[i]] - lb[b.token_ids[i]]) for a, b in zip(outs[True], outs[False])
               for i, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)) if a.token_ids[:i + 1] == b.token_ids[:i + 1])
    r = {"prompts": n_prompts, "identical_token_streams": same, "max_logprob_diff": diff,
         "steps": paths[False], "steps_against": paths[True]}
    print(f"  default vs {against or 'eager'}: {same}/{n_prompts} identical greedy streams of {steps} tokens, "
          f"logprob diff {diff:.2e} (while equal); steps {paths[False]} vs {paths[True]}", flush=True)
    return r


def step_paths(runner) -> dict:
    """How the runner ran its steps so far: decode graphs, mixed-step graphs, eager."""
    mixed = runner.mixed.replays if runner.mixed is not None else 0
    return {"decode_graph": runner.replays, "mixed_graph": mixed, "eager": runner.eager_steps}


def served_engine_args() -> dict:
    """The engine arguments the Triton model starts from (model_repository's model.json), less the
    ones that name the engine and checkpoint: --core-process measures the engine as served, and
    model.json turns prefix caching on where EngineArgs leaves it off."""
    from backend.engine_setup import load_engine_args, pop_backend_options
    from backend.serve import DEFAULT_MODEL_REPOSITORY

    args = load_engine_args(DEFAULT_MODEL_REPOSITORY / "deepseek_v4" / "1" / "model.json")
    pop_backend_options(args)
    for key in ("engine", "engine_core_process", "model", "tokenizer"):
        args.pop(key, None)
    return args


def resolve_model(args) -> str:
    if args.model:
        return args.model
    if args.preset == "tiny":
        return ""
    from engine.models.deepseek_v4.random_checkpoint import write_checkpoint

    out = Path(args.cache_dir) / (args.preset if args.quant == "bf16" else f"{args.preset}-{args.quant}")
    if not (out / "config.json").exists():
        write_checkpoint(out, args.preset, seed=0, device="cuda" if torch.cuda.is_available() else "cpu",
                         quant=args.quant)
    return str(out)


async def run_online(engine_args: dict, args, vocab_hint: list[int]) -> list[Result]:
    # --core-process: the serving engine as Triton's model gets it (engine core in its own process)
    engine = CoreClient(engine_args) if args.core_process else AsyncLLM(engine_args)
    await engine.start()
    vocab = load_config(resolve_model_dir(engine_args.get("model", ""))).vocab_size
    vocab_hint.append(vocab)
    results = []
    try:
        for c in args.concurrency:
            if args.duration:
                results.append(await windowed(engine, args, c, vocab))
            elif args.workload == "agentic":
                convs = agentic_conversations(c, args.turns, args.input_len, args.turn_len, vocab, seed=c)
                results.append(await online(engine, "agentic", c, convs, args.output_len, args.core_process))
            else:
                n = max(c * args.requests_per_user, 1)
                prompts = random_prompts(n, args.input_len, vocab, seed=c)
                results.append(await online(engine, "random", c, [[p] for p in prompts], args.output_len,
                                            args.core_process))
            print(f"  done: {args.workload} concurrency {c}", flush=True)
    finally:
        await engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--quant", default="bf16", choices=QUANTS, help="--preset's weights as stored: bf16, fp8 "
                    "(FP8 linears and experts, as Base), fp8-fp4 (MXFP4 experts, as V4-Flash ships)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "deepseek-v4-triton"))
    ap.add_argument("--workload", default="random", choices=["random", "agentic"])
    ap.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="online runs at these concurrencies ('' for none)")
    ap.add_argument("--input-len", type=int, default=128, help="random: prompt tokens; agentic: system prompt")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--requests-per-user", type=int, default=2, help="online, \"drain\" accounting (the default)")
    ap.add_argument("--duration", type=float, default=None, help="online, \"window\" accounting: seconds of "
                    "closed-loop load per level, the warm-up included (as loadtest.sweep's --duration)")
    ap.add_argument("--warmup", type=float, default=0.0, help="with --duration: the first seconds the rates and "
                    "latencies leave out (loadtest.window)")
    ap.add_argument("--stop-timeout", type=float, default=None, help="with --duration: seconds in-flight requests "
                    "get to finish after it (default 30); the rest are cancelled (their streamed tokens count)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--offline", type=int, default=0, help="also run N prompts offline")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--baseline", action="store_true", help="kernels=ref, enforce_eager, no prefix cache")
    ap.add_argument("--core-process", action="store_true",
                    help="online runs through CoreClient (the engine core in its own process), with the served "
                    "model.json's engine arguments under --engine-args: the engine Triton serves")
    ap.add_argument("--hf-peer", default="", help="also time transformers eager at these batch sizes, e.g. 1,8,32")
    ap.add_argument("--floor", action="store_true", help="report the decode memory floor (GPU)")
    ap.add_argument("--steady", default=None, help="batch sizes: time decode-only steps (after prefill)")
    ap.add_argument("--sampling", default="{}", help="--steady's requests' SamplingParams fields as JSON, e.g. "
                    "'{\"temperature\": 0.8, \"top_p\": 0.95}' (default greedy)")
    ap.add_argument("--check-graphs", action="store_true", help="compare CUDA graphs with eager first (GPU)")
    ap.add_argument("--check-kernels", action="store_true", help="compare the default engine with the torch "
                    "references run eagerly first (GPU; --check-graphs does it too)")
    ap.add_argument("--allow-client-bound", action="store_true", help="exit 0 even when an online level's "
                    "clients were the limit (loadtest.saturation; the level is still marked)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.duration is not None and not 0 <= args.warmup < args.duration:
        ap.error(f"--warmup ({args.warmup:g} s) must be at least 0 and below --duration ({args.duration:g} s)")
    if args.duration is None and (args.warmup or args.stop_timeout is not None):
        ap.error("--warmup and --stop-timeout go with --duration")
    args.stop_timeout = 30.0 if args.stop_timeout is None else args.stop_timeout
    if args.stop_timeout < 0:
        ap.error("--stop-timeout must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the loader's progress
    engine_args = {"model": resolve_model(args), **json.loads(args.engine_args)}
    if args.core_process:
        engine_args = {**served_engine_args(), **engine_args}
    if args.baseline:
        engine_args.update(BASELINE)
    EngineArgs.from_dict(engine_args)  # fail fast on a typo
    results, vocab, extra = [], [], {}
    if args.check_graphs:
        extra["check_graphs"] = check_graphs(engine_args)
    if args.check_graphs or args.check_kernels:
        extra["check_kernels"] = check_graphs(engine_args, against={"kernels": "ref", "enforce_eager": True})
    if args.steady:
        extra["steady_decode"] = steady_decode(engine_args, [int(b) for b in args.steady.split(",")], args.input_len,
                                               sampling=json.loads(args.sampling))
    if args.floor:
        steady = [int(b) for b in args.steady.split(",")] if args.steady else []
        extra["decode_floor"] = decode_floors(engine_args, sorted(set(args.concurrency) | set(steady)))
        for f in extra["decode_floor"]:
            print(f"  decode floor at batch {f['batch']}: {f['weight_bytes'] / 1e9:.2f} GB / "
                  f"{f['copy_TB_s']:.2f} TB/s = {f['floor_ms']:.3f} ms", flush=True)
        if args.steady:
            extra["per_layer"] = per_layer(extra["steady_decode"], extra["decode_floor"])
    if args.hf_peer:
        extra["hf_peer"] = hf_peer(engine_args["model"], [int(b) for b in args.hf_peer.split(",")], args.input_len)
        torch.cuda.empty_cache()
    if args.offline:
        llm = LLM(**engine_args)
        results.append(offline(llm, random_prompts(args.offline, args.input_len, llm.engine.cfg.vocab_size, 0),
                               args.output_len))
        del llm
    if args.concurrency:
        results += asyncio.run(run_online(engine_args, args, vocab))
    if args.floor:
        cfg = load_config(resolve_model_dir(engine_args.get("model", "")))
        extra["ttft_floor"] = ttft_vs_floor(results, extra["decode_floor"], cfg)
    print_table(results)
    if args.json:
        meta = {"label": args.label, "engine_args": engine_args, "machine": platform.platform(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "argv": vars(args)}
        payload = {"meta": meta, "results": [asdict(r) | {"output_tok_s": r.output_tok_s} for r in results], **extra}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.json}")
    bound = [r for r in results if r.saturation.get("client_bound")]
    for r in bound:
        print(f"{'warning' if args.allow_client_bound else 'error'}: online c={r.concurrency} was client-bound: "
              f"{'; '.join(r.saturation['reasons'])}", flush=True)
    return 3 if bound and not args.allow_client_bound else 0


if __name__ == "__main__":
    sys.exit(main())
