"""What each kernel variant (kernels/variants.py) does to prefill end to end at depth: the time to first token of
a batch of prompts prefilled together, under each variant set in turn, in one engine load (an engine start at
V4-Flash depth costs minutes), with a check that each set's first tokens equal the first set's on the same prompts.

    python -m tools.bench_prefill_variants --model CKPT [--sets none,rope_tiles,mix_bf16x3,all]
        [--shapes 1x1024,4x1024,1x8192] [--rounds 5] [--engine-args JSON] [--json OUT]   (suite prefill_variants)

A set is "none" (every variant off), "all", or variant names joined by '+' (rope_tiles+mix_bf16x3); sets are
separated by ','. A shape NxL is N prompts of L tokens generated to their first token together: the generate
call's wall time is the batch's time to first token (prompts over max_num_batched_tokens run in chunks, as served).

Prefill runs eagerly (cudagraph_mode FULL_DECODE_ONLY), so a variant switched between generate calls takes effect
on the next prefill; prefix caching is off, so the same prompts under every set are prefilled whole. Per round and
shape, fresh random prompts run under every set in turn (rounds interleave the sets, so drift hits all alike),
after one uncounted warm-up round of every set and shape (first-call compiles).
Tokens that differ are printed, not failed: some variants round differently and random weights flip near-ties.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.suites import DEPTH
from engine.llm import LLM
from engine.request import SamplingParams
from kernels import variants
from tools.bench_engine import random_prompts
from tools.kernel_device import sync

# decode graphs only (prefill eager, so a switch between calls holds), and nothing reused between the sets' runs
PREFILL_ARGS = {"cudagraph_mode": "FULL_DECODE_ONLY", "enable_prefix_caching": False}
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass(frozen=True)
class VariantSet:
    name: str  # as given on the command line
    spec: str  # for variants.set_variants
    on: tuple[str, ...]  # the variants it turns on


@dataclass(frozen=True)
class Shape:
    prompts: int
    prompt_len: int

    @property
    def name(self) -> str:
        return f"{self.prompts}x{self.prompt_len}"


def parse_sets(text: str) -> list[VariantSet]:
    """'none,rope_tiles,rope_tiles+mix_bf16x3,all' -> the sets; unknown variant names are refused here."""
    sets = []
    for name in filter(None, text.split(",")):
        spec = "" if name == "none" else name.replace("+", ",")
        variants.set_variants(spec)  # validates the names
        sets.append(VariantSet(name, spec, variants.enabled()))
    variants.set_variants(variants.DEFAULT)
    return sets


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for part in text.split(","):
        n, _, length = part.partition("x")
        shapes.append(Shape(int(n), int(length)))
    return shapes


def first_tokens(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """The batch prefilled to its first tokens: wall ms (the sampled tokens are read back, so the GPU is done)."""
    sync()  # nothing earlier counted
    t = time.perf_counter()
    done = llm.generate(prompts, FIRST_TOKEN)
    return (time.perf_counter() - t) * 1e3, [c.token_ids[0] for c in done]


def drop_requests(llm: LLM) -> None:
    """What a failed generate left in the engine, aborted, so the next set starts empty."""
    eng = llm.engine
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.flush()


def run(llm: LLM, shapes: list[Shape], sets: list[VariantSet], rounds: int) -> list[dict]:
    """Round -1 is the warm-up. A (shape, set) that fails once is an error row and is not run again."""
    times = {(sh.name, s.name): [] for sh in shapes for s in sets}
    equal = dict.fromkeys(times, 0)
    total = dict.fromkeys(times, 0)
    errors: dict[tuple[str, str], str] = {}
    for r in range(-1, rounds):
        for i, sh in enumerate(shapes):
            prompts = random_prompts(sh.prompts, sh.prompt_len, llm.engine.cfg.vocab_size, seed=1000 * (r + 1) + i)
            reference = None  # the first set's tokens on these prompts
            for s in sets:
                key = (sh.name, s.name)
                if key in errors:
                    continue
                variants.set_variants(s.spec)
                try:
                    ms, tokens = first_tokens(llm, prompts)
                except Exception as e:  # a set that fails is reported; the others still run
                    errors[key] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  {sh.name} {s.name}: FAILED {errors[key]}", flush=True)
                    drop_requests(llm)
                    continue
                if s is sets[0]:
                    reference = tokens
                if r < 0:
                    continue
                times[key].append(ms)
                if reference is not None:
                    equal[key] += sum(a == b for a, b in zip(tokens, reference))
                    total[key] += len(tokens)
    rows = []
    for sh in shapes:
        base = times[(sh.name, sets[0].name)]
        for s in sets:
            key = (sh.name, s.name)
            row = {"shape": sh.name, "prompts": sh.prompts, "prompt_len": sh.prompt_len, "set": s.name,
                   "variants": list(s.on)}
            if key in errors:
                rows.append(row | {"error": errors[key]})
                continue
            med = statistics.median(times[key])
            row |= {"times_ms": times[key], "median_ms": med, "min_ms": min(times[key]),
                    "speedup": statistics.median(base) / med if base else None,
                    "tokens_equal": equal[key], "tokens_total": total[key]}
            rows.append(row)
    return rows


def print_table(rows: list[dict], first: str) -> None:
    print(f"{'shape':>8} {'set':<34} {'median ms':>10} {'min ms':>9} {'vs ' + first:>12}  first tokens = {first}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>8} {r['set']:<34} ERROR {r['error']}")
            continue
        speedup = f"{r['speedup']:11.3f}x" if r["speedup"] is not None else f"{'-':>12}"
        same = f"{r['tokens_equal']}/{r['tokens_total']}"
        print(f"{r['shape']:>8} {r['set']:<34} {r['median_ms']:10.1f} {r['min_ms']:9.1f} {speedup}  {same}"
              + ("" if r["tokens_equal"] == r["tokens_total"] else "  DIFFERENT"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help='a checkpoint directory ("": the tiny default, a CPU smoke run)')
    ap.add_argument("--sets", default="none,rope_tiles,mix_bf16x3,all",
                    help="','-separated; within a set, variants joined by '+'; 'none': every variant off")
    ap.add_argument("--shapes", default="1x1024,4x1024,1x8192", help="NxL: N prompts of L tokens, together")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine-args", default="{}", help="JSON on top of DEPTH and the prefill arguments")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds: at least 1 counted round")
    sets, shapes = parse_sets(a.sets), parse_shapes(a.shapes)
    engine_args = json.loads(DEPTH) | PREFILL_ARGS | json.loads(a.engine_args)
    llm = LLM(model=a.model, **engine_args)
    limit = llm.engine.max_model_len - 1
    for sh in [sh for sh in shapes if sh.prompt_len > limit]:
        print(f"  {sh.name}: skipped, {sh.prompt_len} tokens exceed max_model_len - 1 = {limit}", flush=True)
    shapes = [sh for sh in shapes if sh.prompt_len <= limit]
    try:
        rows = run(llm, shapes, sets, a.rounds)
    finally:
        variants.set_variants(variants.DEFAULT)
    print_table(rows, sets[0].name)
    if a.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        Path(a.json).write_text(json.dumps({"engine_args": {"model": a.model, **engine_args}, "device": device,
                                            "rows": rows}, indent=1))
    return 0 if any("median_ms" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
