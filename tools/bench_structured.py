"""Structured outputs' step-time overhead: decode steps at batch 1, 32, 150 with 0%, 50% and 100%
of the requests constrained by a JSON schema (xgrammar bitmask per row, applied on the device).

    .venv/bin/python -m tools.bench_structured [--model DIR] [--steps 8] [--json docs/perf/bench_structured.json]

Prints a table and writes JSON. The tiny model by default (CPU: the model step is small, so the
sampler's and the grammar's share shows); every request decodes greedily and none can finish
during the timed steps (the schema needs far more tokens; free requests ignore EOS).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from engine.args import resolve_model_dir
from engine.llm import LLM
from engine.request import GenerationRequest, SamplingParams

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
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    running = len(eng.scheduler.running)
    for rid in list(eng.requests):
        eng.abort(rid)
    return {"batch": batch, "constrained_fraction": fraction, "running": running,
            "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches", default="1,32,150")
    ap.add_argument("--json", default="docs/perf/bench_structured.json")
    a = ap.parse_args()
    llm = LLM(str(resolve_model_dir(a.model)), max_num_seqs=160, max_model_len=1024)
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
            rows.append(row)
            print(f"batch {batch:4d}  constrained {fraction:4.0%}  step min {row['step_ms_min']:7.2f} ms "
                  f"median {row['step_ms_median']:7.2f} ms  overhead (min) {row['overhead_pct_min']:+6.1f}%  "
                  f"running {row['running']}", flush=True)
    print(f"schema compile: {compile_s * 1e3:.1f} ms first, {cached_s * 1e3:.3f} ms cached")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
           "model": a.model, "schema_compile_ms": compile_s * 1e3, "schema_cached_ms": cached_s * 1e3, "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
