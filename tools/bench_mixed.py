"""Mixed prefill + decode steps and the chunked-prefill token budget (a script, not a test).

One engine, loaded once, with mixed-step graphs captured up to the largest budget; then:
0. a check: the same prompts with the mixed-step graphs and eager (greedy tokens, logprobs);
1. step times: `--decoders` streams decoding while a long prompt is prefilled in chunks of the
   budget, each step timed with the mixed-step graphs and eagerly (the runner's graphs set aside),
   next to the pure-decode step at that batch;
2. the budget sweep: per `--policies` entry (`fixed`: every `max_num_batched_tokens` of `--budgets`;
   `adaptive` or `adaptive:F`: engine/chunk_budget.py's per-step budget under the largest budget, with
   itl_target_factor F) and per `--users` level, a closed loop of that many users (each sends its next
   request when the last one finishes; `--requests-per-user` each) driving the engine's step loop
   directly: TTFT, ITL (per token), output tok/s, the steps' token counts, how the steps ran (graphs
   or eager) and, adaptive, the step costs it fitted. One engine serves every row (the policy is
   swapped between rows), so the rows differ only in the budget.
Prints a table and writes JSON.

    python -m tools.bench_mixed --preset flash-depth --quant fp8-fp4 --budgets 256,512,1024,2048 \
        --users 64 --input-len 1024 --output-len 128 --json out.json
    python -m tools.bench_mixed --preset flash-depth --quant fp8-fp4 --budgets 2048 --policies fixed,adaptive \
        --users 64,150 --check-budget 0 --step-budgets "" --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.chunk_budget import ChunkBudget, ChunkBudgetConfig
from engine.graphs.mixed import MixedStepGraphs
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4.random_checkpoint import PRESETS, QUANTS
from engine.request import GenerationRequest, SamplingParams
from tools import mixed_diag
from tools.bench_engine import _pct, random_prompts, resolve_model, step_paths
from tools.kernel_device import sync


def set_budget(eng: LLMEngine, budget: int, policy: ChunkBudgetConfig | None = None) -> None:
    """The scheduler's token budget, its cap under an adaptive policy (the runner has graphs for every
    budget up to the captured one); a fresh policy (fixed by default), which learns its step costs anew."""
    eng.scheduler.max_num_batched_tokens = budget
    eng.scheduler.max_chunk = eng.args.long_prefill_token_threshold or budget
    eng.scheduler.chunk_budget = ChunkBudget(policy or ChunkBudgetConfig(), eng.scheduler.max_num_seqs)


def parse_policy(spec: str) -> ChunkBudgetConfig:
    """`fixed`, `adaptive`, or `adaptive:F` (itl_target_factor F)."""
    mode, _, factor = spec.partition(":")
    if mode not in ("fixed", "adaptive") or (factor and mode == "fixed"):
        raise argparse.ArgumentTypeError(f"policy {spec!r}: fixed, adaptive or adaptive:FACTOR")
    return ChunkBudgetConfig(mode, itl_target_factor=float(factor)) if factor else ChunkBudgetConfig(mode)


def policy_label(policy: ChunkBudgetConfig) -> str:
    return "fixed" if policy.mode == "fixed" else f"adaptive x{policy.itl_target_factor:g}"


def _drain(eng: LLMEngine) -> None:
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.flush()
    while eng.has_unfinished():
        eng.step()


def _generate(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> list[tuple[list, list]]:
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"{tag}-{i}", prompt_token_ids=p, sampling=sp))
    got = {f"{tag}-{i}": ([], []) for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id][0].extend(o.token_ids)
            got[o.request_id][1].extend(o.logprobs or [])
    return list(got.values())


def check_mixed(eng: LLMEngine, budget: int, n_prompts: int = 8, steps: int = 16, diagnose: bool = False) -> dict:
    """The same prompts (lengths spread so the budget splits them into chunks mixed with decodes)
    with the mixed-step graphs and with those steps eager: greedy tokens and logprobs. diagnose:
    then once more with every graph step checked against its eager runs (tools/mixed_diag.py)."""
    set_budget(eng, budget)
    vocab = eng.cfg.vocab_size
    longest = min(100 + 211 * n_prompts, eng.max_model_len - steps - 2)
    prompts = [p[:min(100 + 211 * i, longest)] for i, p in enumerate(random_prompts(n_prompts, longest, vocab, 11))]
    sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=1)
    before = step_paths(eng.runner)
    graph = _generate(eng, prompts, sp, "check-graph")
    paths = {k: v - before[k] for k, v in step_paths(eng.runner).items()}
    mixed, eng.runner.mixed = eng.runner.mixed, None
    try:
        eager = _generate(eng, prompts, sp, "check-eager")
        if mixed is not None:  # the same padded batches run eagerly: tells capture faults from padding's rounding
            eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, mixed.max_num_seqs, mixed.sizes)
            padded = _generate(eng, prompts, sp, "check-padded")
    finally:
        eng.runner.mixed = mixed
    r = {"budget": budget, "prompts": n_prompts, "graph_run_steps": paths}
    for name, other in (("eager", eager), ("padded_eager", padded if mixed is not None else None)):
        if other is None:
            continue
        same = sum(a[0] == b[0] for a, b in zip(graph, other))
        diff = max((abs(la[t] - lb[t]) for (ta, pa), (tb, pb) in zip(graph, other)
                    for i, (t, la, lb) in enumerate(zip(ta, pa, pb)) if ta[:i + 1] == tb[:i + 1]), default=0.0)
        r[name] = {"identical_token_streams": same, "max_logprob_diff": diff}
        print(f"  check: mixed-step graphs vs {name.replace('_', ' ')} at budget {budget}: {same}/{n_prompts} "
              f"identical greedy streams of {steps} tokens, logprob diff {diff:.2e} (while equal); graph run's "
              f"steps {paths}", flush=True)
    if diagnose:
        rows = mixed_diag.diagnose(eng, lambda: _generate(eng, prompts, sp, "check-diag"))
        r["diagnosis"] = rows
        _summary("", rows)
        used = sorted({d["graph_size"] for d in rows if d["path"] == "mixed"})
        if mixed is not None and used and torch.cuda.is_available():
            # the same sizes captured again into a pool of their own, after everything else: if these
            # replay right, the fault is in sharing the pool (with the decode graphs or other sizes)
            try:
                eng.runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, mixed.max_num_seqs, used,
                                              torch.cuda.graph_pool_handle())
                r["diagnosis_own_pool"] = mixed_diag.diagnose(
                    eng, lambda: _generate(eng, prompts, sp, "check-diag-own"), " (own pool)")
                _summary(" (sizes recaptured in their own pool)", r["diagnosis_own_pool"])
            except torch.OutOfMemoryError as e:  # the first diagnosis stands; say why this one is missing
                print(f"  diag (own pool): not run, out of GPU memory ({e})", flush=True)
                _drain(eng)
            finally:
                eng.runner.mixed = mixed
    return r


def _summary(label: str, rows: list[dict]) -> None:
    bad = [d for d in rows if d["first_difference"] is not None]
    first = f"step {bad[0]['step']} ({bad[0]['path']}), its line above" if bad else "none"
    print(f"  diag{label}: {len(rows)} graph steps, {len(bad)} with a cache write differing from eager; first: "
          f"{first}", flush=True)


def step_times(eng: LLMEngine, budget: int, decoders: int, steps: int, context: int) -> dict:
    """ms per step: `decoders` decodes plus a prefill chunk filling the budget, graphed and eager;
    and the pure-decode step at the same batch."""
    set_budget(eng, eng.args.max_num_batched_tokens)  # the decoders' prompts at the full budget
    vocab = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=eng.max_model_len - context - 1, temperature=0, ignore_eos=True)
    for i, p in enumerate(random_prompts(decoders, context, vocab, seed=budget)):
        eng.add_request(GenerationRequest(f"dec-{budget}-{i}", prompt_token_ids=p, sampling=sp))
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    set_budget(eng, budget)
    chunk = budget - decoders
    row = {"budget": budget, "decoders": decoders, "chunk_tokens": chunk}

    def timed(label: str) -> None:
        # long prompts enough for every timed step's chunk (each under max_model_len; the next one
        # fills a step's budget where the last one ends)
        need, cap = (steps + 2) * chunk, eng.max_model_len - 2
        for j, p in enumerate(random_prompts(-(-need // cap), cap, vocab, seed=7)):
            eng.add_request(GenerationRequest(f"long-{budget}-{label}-{j}", prompt_token_ids=p,
                                              sampling=SamplingParams(max_tokens=1, temperature=0)))
        eng.step()  # admits the first: from here each step is the decodes + one chunk
        before = step_paths(eng.runner)
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        row[f"{label}_ms"] = (time.perf_counter() - t) / steps * 1e3
        row[f"{label}_steps"] = {k: v - before[k] for k, v in step_paths(eng.runner).items()}
        for rid in [r for r in eng.requests if r.startswith(f"long-{budget}-{label}-")]:
            eng.abort(rid)

    timed("graph")
    mixed, eng.runner.mixed = eng.runner.mixed, None  # the same steps eagerly
    try:
        timed("eager")
    finally:
        eng.runner.mixed = mixed
    eng.flush()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    row["decode_ms"] = (time.perf_counter() - t) / steps * 1e3
    _drain(eng)
    print(f"  budget {budget}: {decoders} decodes + {chunk} prefill tokens: graph {row['graph_ms']:.1f} ms, "
          f"eager {row['eager_ms']:.1f} ms (steps {row['graph_steps']} / {row['eager_steps']}); "
          f"decode alone {row['decode_ms']:.1f} ms", flush=True)
    return row


def closed_loop(eng: LLMEngine, budget: int, users: int, requests_per_user: int, input_len: int,
                output_len: int, policy: ChunkBudgetConfig | None = None) -> dict:
    """`users` streams, each sending its next request when its last finishes, on the engine's own
    step loop (the async front adds a thread hop, not scheduling)."""
    policy = policy or ChunkBudgetConfig()
    set_budget(eng, budget, policy)
    tokens_before = [list(b) for b in eng.iteration_tokens]
    total = users * requests_per_user
    prompts = random_prompts(total, input_len, eng.cfg.vocab_size, seed=budget + users)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    added, last, ttft, itl = {}, {}, [], []
    issued = done = out_tokens = steps = 0
    before = step_paths(eng.runner)
    t0 = time.perf_counter()
    while done < total:
        while issued < total and issued - done < users:
            rid = f"loop-{policy_label(policy)}-{budget}-{users}-{issued}"
            eng.add_request(GenerationRequest(rid, prompt_token_ids=prompts[issued], sampling=sp))
            added[rid] = time.perf_counter()
            issued += 1
        outs = eng.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                if o.request_id in last:
                    itl.append((now - last[o.request_id]) * 1e3 / len(o.token_ids))
                else:
                    ttft.append((now - added[o.request_id]) * 1e3)
                last[o.request_id] = now
            if o.finished:
                done += 1
                out_tokens += o.num_output_tokens
    dt = time.perf_counter() - t0
    paths = {k: v - before[k] for k, v in step_paths(eng.runner).items()}
    # steps by token count: [steps, tokens] per power-of-two bucket (2^(k-1), 2^k], the engine's own counters
    step_tokens = {2 ** k: [a - b for a, b in zip(now_, before_)]
                   for k, (now_, before_) in enumerate(zip(eng.iteration_tokens, tokens_before)) if now_[0] > before_[0]}
    row = {"policy": policy_label(policy), "budget": budget, "users": users, "requests": total, "duration_s": dt,
           "output_tok_s": out_tokens / dt, "tok_s_per_user": 1e3 / _pct(itl)["p50"] if itl else 0.0,
           "ttft_ms": _pct(ttft), "itl_ms": _pct(itl), "steps": steps, "step_paths": paths,
           "step_tokens": step_tokens}
    if policy.mode == "adaptive":  # what it learned: the decode and prefill costs its budgets came from
        cb = eng.scheduler.chunk_budget
        row["fitted"] = {"decode_ms_at_users": cb.costs.decode_ms(users), "target_ms": cb.target_ms(),
                         "ms_per_prefill_token": cb.costs.ms_per_prefill_token(), "steps_seen": cb.costs.samples}
    print(f"  {row['policy']}, budget {budget}: {users} users: {row['output_tok_s']:.0f} out tok/s, TTFT p50/p90 "
          f"{row['ttft_ms']['p50']:.0f}/{row['ttft_ms']['p90']:.0f} ms, ITL p50/p90 {row['itl_ms']['p50']:.1f}/"
          f"{row['itl_ms']['p90']:.1f} ms, steps {paths}", flush=True)
    return row


def print_tables(times: list[dict], sweep: list[dict]) -> None:
    if times:
        print("\nbudget | decodes + prefill tokens | mixed graph ms | mixed eager ms | eager / graph | decode alone ms")
        for r in times:
            print(f"{r['budget']} | {r['decoders']} + {r['chunk_tokens']} | {r['graph_ms']:.1f} | {r['eager_ms']:.1f} | "
                  f"{r['eager_ms'] / r['graph_ms']:.2f} | {r['decode_ms']:.1f}")
    if sweep:
        print("\npolicy | budget (cap) | users | out tok/s | tok/s/user (1/ITL p50) | TTFT p50 ms | TTFT p90 ms | "
              "ITL p50 ms | ITL p90 ms | eager steps / all")
        for r in sweep:
            print(f"{r.get('policy', 'fixed')} | {r['budget']} | {r['users']} | {r['output_tok_s']:.0f} | "
                  f"{r['tok_s_per_user']:.1f} | "
                  f"{r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p90']:.0f} | {r['itl_ms']['p50']:.1f} | "
                  f"{r['itl_ms']['p90']:.1f} | {r['step_paths']['eager']} / {r['steps']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--quant", default="bf16", choices=QUANTS)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "deepseek-v4-triton"))
    ap.add_argument("--budgets", default="256,512,1024,2048", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--step-budgets", default=None, type=lambda s: [int(x) for x in s.split(",") if x],
                    help="budgets of the graph-vs-eager step timing (default: --budgets)")
    ap.add_argument("--users", default=[64], type=lambda s: [int(x) for x in s.split(",")],
                    help="closed-loop levels (the step timing uses the largest)")
    ap.add_argument("--policies", default=[ChunkBudgetConfig()], type=lambda s: [parse_policy(x) for x in s.split(",")],
                    help="fixed (every --budgets), adaptive or adaptive:ITL_TARGET_FACTOR (under the largest budget)")
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="steps timed per step-time row")
    ap.add_argument("--check-budget", type=int, default=512, help="first compare mixed-step graphs with eager "
                    "at this budget (0: skip)")
    ap.add_argument("--check-only", action="store_true", help="only the graphs-vs-eager check (and --diagnose)")
    ap.add_argument("--diagnose", action=argparse.BooleanOptionalAction, default=None,
                    help="after the check, every graph step against its eager runs: where the graph first "
                    "parts from them (layer, cache write); default: on with --check-only")
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    users = max(args.users)
    ea = {"model": resolve_model(args), "max_num_seqs": max(users, 16), "cudagraph_mode": "FULL",
          **json.loads(args.engine_args),
          "max_num_batched_tokens": max(args.budgets)}  # graphs for every budget of the sweep
    eng = LLMEngine(ea)
    meta = {"engine_args": ea, "argv": vars(args) | {"policies": [policy_label(p) for p in args.policies]},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    out = {"meta": meta, "check": None, "step_times": [], "sweep": []}

    def save() -> None:  # after every row: a run cut short by its time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))

    if args.check_budget:
        diagnose = args.check_only if args.diagnose is None else args.diagnose
        out["check"] = check_mixed(eng, args.check_budget, diagnose=diagnose)
        save()
    if args.check_only:
        return
    for b in args.budgets if args.step_budgets is None else args.step_budgets:
        if b > users:
            out["step_times"].append(step_times(eng, b, users, args.steps, min(args.input_len, eng.max_model_len // 4)))
            save()
    for policy in args.policies:  # policy by policy: a run cut short still compares the first ones at every level
        for u in args.users:
            for b in args.budgets if policy.mode == "fixed" else [max(args.budgets)]:
                out["sweep"].append(closed_loop(eng, b, u, args.requests_per_user, args.input_len, args.output_len,
                                                policy))
                save()
    print_tables(out["step_times"], out["sweep"])
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
