"""The engine's own Python work per decode step, without the model: at batch 150 on the H200 the
host's share of a step (scheduling, packing, reading back, detokenizing, building outputs) is
close to the GPU's, so it is measured on its own here, on any machine.

    python -m tools.profile_host [--model DIR] [--batch 150] [--steps 60] [--stop-strings]

host = step wall time - the model's forward - the wait for the GPU's tokens; `outputs` is the part
spent turning sampled tokens into streamed deltas (detokenizer, stop strings, RequestOutput).
Prints one table row and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.in_flight import InFlight
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams


class _Timer:
    """Accumulates the wall time of the calls it wraps."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def measure(model: str, batch: int, steps: int, prompt_len: int, stop_strings: bool) -> dict:
    eng = LLMEngine({"model": model, "max_num_seqs": max(batch, 8), "max_num_batched_tokens": max(8192, batch * prompt_len)})
    sp = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True,
                        stop=["\u2603never\u2603"] if stop_strings else [])
    for i in range(batch):
        prompt = [5 + (i * 31 + j * 7) % 3000 for j in range(prompt_len)]
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=prompt, sampling=sp))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()  # prefill, untimed
    forward, wait, outputs = _Timer(), _Timer(), _Timer()
    eng.runner.model.forward = forward.wrap(eng.runner.model.forward)
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    read = InFlight.read
    InFlight.read = wait.wrap(read)
    eng._process = outputs.wrap(eng._process)
    try:
        n, t0 = 0, time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            n += 1
        sync()
        wall = time.perf_counter() - t0
    finally:
        InFlight.read = read
    per = lambda s: s / n * 1e3
    return {"batch": batch, "steps": n, "device": eng.device.type, "stop_strings": stop_strings,
            "step_ms": per(wall), "forward_ms": per(forward.seconds), "gpu_wait_ms": per(wait.seconds),
            "host_ms": per(wall - forward.seconds - wait.seconds), "outputs_ms": per(outputs.seconds),
            "outputs_us_per_token": outputs.seconds / max(1, n * batch) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/tiny")
    ap.add_argument("--batch", type=int, default=150)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--stop-strings", action="store_true", help="every request has a stop string (never hit)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = measure(a.model, a.batch, a.steps, a.prompt_len, a.stop_strings)
    print("batch | steps | host ms/step | of which outputs | us per token (outputs) | forward ms/step | GPU wait ms/step")
    print(f"{r['batch']} | {r['steps']} | {r['host_ms']:.2f} | {r['outputs_ms']:.2f} | {r['outputs_us_per_token']:.1f} | "
          f"{r['forward_ms']:.1f} | {r['gpu_wait_ms']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
