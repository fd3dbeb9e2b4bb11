"""Structured outputs' step-time overhead: decode steps at batch 1, 32, 150 with 0%, 50% and 100%
of the requests constrained by a JSON schema (xgrammar bitmask per row, applied on the device).

    .venv/bin/python -m tools.bench_structured [--model DIR | --preset tiny|flash-shaped] [--steps 8]
        [--engine-args JSON] [--json docs/perf/bench_structured.json]

Prints a table and writes JSON. The tiny model by default (CPU: the model step is small, so the
sampler's and the grammar's share shows); on a GPU `--preset flash-shaped` (V4-Flash's per-layer
shapes, drawn on the GPU into --cache-dir, as tools.bench_engine does) with CUDA graphs and async
scheduling: unconstrained greedy steps stay in flight, constrained ones read back each step. Every
request decodes greedily and none can finish during the timed steps (the schema needs far more
tokens; free requests ignore EOS). `step_ms_mean` is the wall time of all timed steps (the last
one read back) over their number: with async scheduling the one figure a single step cannot give.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.args import resolve_model_dir
from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import PRESETS
from engine.request import GenerationRequest, SamplingParams
from tools.bench_engine import resolve_model

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 80, "maxItems": 80,
                                                     "items": {"type": "object", "properties": {
                                                         "id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                         "tag": {"type": "string", "maxLength": 6},
                                                         "ok": {"type": "boolean"}},
                                                         "required": ["id", "tag", "ok"]}}},
          "required": ["items"]}


def params(constrained: bool) -> SamplingParams:
    if constrained:
        return SamplingParams(max_tokens=400, temperature=0, structured_outputs={"json": SCHEMA})
    return SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def measure(llm: LLM, batch: int, fraction: float, steps: int) -> dict:
    eng = llm.engine
    n_constrained = round(batch * fraction)
    for i in range(batch):
        eng.add_request(GenerationRequest(f"b{batch}-{fraction}-{i}", prompt_token_ids=[5 + (i * 7 + j) % 900 for j in range(24)],
                                          sampling=params(i < n_constrained)))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    for _ in range(2):
        eng.step()  # warm decode
    eng.flush()
    times = []
    first = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    eng.flush()  # the step still in flight (async scheduling) counts too
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = time.perf_counter() - first
    running = len(eng.scheduler.running)
    for rid in list(eng.requests):
        eng.abort(rid)
    return {"batch": batch, "constrained_fraction": fraction, "running": running,
            "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
            "step_ms_mean": 1e3 * total / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: --preset's)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "deepseek-v4-triton"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches", default="1,32,150")
    ap.add_argument("--engine-args", default="{}", help="JSON of engine arguments over the defaults here")
    ap.add_argument("--json", default="docs/perf/bench_structured.json")
    a = ap.parse_args()
    if a.preset != "tiny" and not a.model and not torch.cuda.is_available():
        raise SystemExit(f"--preset {a.preset} is a GPU benchmark (no CUDA device here); the CPU figures use the tiny model")
    # the preset's random checkpoint, drawn on the GPU once into --cache-dir (tools.bench_engine's)
    model = resolve_model(argparse.Namespace(model=a.model, preset=a.preset, quant="bf16", cache_dir=a.cache_dir))
    engine_args = {"max_num_seqs": 160, "max_model_len": 1024, **json.loads(a.engine_args)}
    llm = LLM(str(resolve_model_dir(model or "tiny")), **engine_args)
    compiler = llm.engine.grammar_compiler()  # xgrammar's tokenizer info: built once per engine
    start = time.perf_counter()
    compiler.compile({"json": SCHEMA}).result()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile({"json": SCHEMA}).result()
    cached_s = time.perf_counter() - start
    rows = []
    for batch in map(int, a.batches.split(",")):
        base = None
        for fraction in (0.0, 0.5, 1.0) if batch > 1 else (0.0, 1.0):  # half of one request is no request
            row = measure(llm, batch, fraction, a.steps)
            base = base or row
            # the minimum is the figure least disturbed by other work on a shared machine
            row["overhead_pct_min"] = 100 * (row["step_ms_min"] / base["step_ms_min"] - 1)
            row["overhead_pct_median"] = 100 * (row["step_ms_median"] / base["step_ms_median"] - 1)
            row["overhead_pct_mean"] = 100 * (row["step_ms_mean"] / base["step_ms_mean"] - 1)
            rows.append(row)
            print(f"batch {batch:4d}  constrained {fraction:4.0%}  step min {row['step_ms_min']:7.2f} ms "
                  f"median {row['step_ms_median']:7.2f} ms  mean {row['step_ms_mean']:7.2f} ms  "
                  f"overhead (min) {row['overhead_pct_min']:+6.1f}% (mean) {row['overhead_pct_mean']:+6.1f}%  "
                  f"running {row['running']}", flush=True)
    print(f"schema compile: {compile_s * 1e3:.1f} ms first, {cached_s * 1e3:.3f} ms cached")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    out = {"date": time.strftime("%Y-%m-%d"), "machine": device, "model": a.model or a.preset,
           "engine_args": engine_args, "cuda_graphs": bool(llm.engine.runner.graphs),
           "async_scheduling": llm.engine.async_scheduling, "schema_compile_ms": compile_s * 1e3,
           "schema_cached_ms": cached_s * 1e3, "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
