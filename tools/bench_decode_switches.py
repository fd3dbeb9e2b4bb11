"""Which decode switches pay at depth: PDL (kernels/pdl.py) and each launch-saving fusion
(kernels/fusions.py), one engine load, steady decode timed under each switch set against the
memory floor, with the kernels a decode step launches per layer on the GPU (torch profiler) and a check
that each switch set's logits agree with the first set's on the same input (exit 1 if not).

    python -m tools.bench_decode_switches --model CKPT [--batches 1,32,150] [--configs pdl,base,all,mega_mhc,...]
                                          [--input-len 1024] [--steps 32] [--json OUT]   (suite decode_switches)
    python -m tools.bench_decode_switches --tp-share 8 [--experts 256] [--preset flash-depth] ...
                                          (suite tp_share_switches)

--tp-share N: instead of a checkpoint, rank 0's share of the model at tensor_parallel_size N, built in memory with
the collectives skipped (tools.bench_tp_share: N-th of the heads and experts, 1 / N of the shared expert, the rest
replicated): the step where ~1,500 small kernels set the time, so where launch-saving switches should pay most. Its
floor is the share's weights read over the copy bandwidth, and its "per layer" time includes the LM head's share.

A config is NAME or NAME=pdl:0|1+fuse:LIST+var:LIST (LIST: names joined by '/', "all" or "none"; var: the kernel
variants of kernels/variants.py; where a config does not name them, the set the process started with: DSV4_VARIANTS
or the default); the named ones: base (PDL off, no fusion), pdl (today's default: PDL on, no fusion), fuse (every
fusion), all (both), and one per fusion (`mega_mhc`, ... : that fusion on today's default step, PDL on; at
--single-batches only; `each`: all of those). The first config is the one the others are read against. Per batch
the requests are prefilled once; per config the batch's decode graph is captured again under the config's switches,
then `steps` engine steps are timed (kernels/pdl.py, kernels/fusions.py and kernels/variants.py are read at
capture). The floor is tools.bench_engine.decode_floors' (weights a step reads / copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.suites import DEPTH
from engine.llm import LLM
from engine.request import GenerationRequest, SamplingParams
from kernels import fusions, pdl, variants
from tools.bench_engine import copy_bandwidth, decode_floors, random_prompts
from tools.bench_tp_share import share_floor, share_model
from tools.kernel_device import sync

LOGITS_TOL = 3e-2  # max |difference| / max |logit| between switch sets: 0 where the arithmetic is the same (PDL)


def _names(val: str, every: tuple[str, ...]) -> tuple[str, ...]:
    return every if val == "all" else () if val in ("", "none") else tuple(val.split("/"))


def parse_config(spec: str) -> tuple[str, bool, tuple[str, ...], tuple[str, ...]]:
    """'NAME' or 'NAME=pdl:1+fuse:a/b+var:c/d' -> (name, pdl, fusions, kernel variants)."""
    name, _, body = spec.partition("=")
    if not body:
        named = {"base": (False, ()), "pdl": (True, ()), "fuse": (False, fusions.ALL), "all": (True, fusions.ALL)}
        named |= {f: (True, (f,)) for f in fusions.ALL}
        if name not in named:
            raise ValueError(f"unknown config {name!r}: one of {', '.join(named)} or NAME=pdl:0|1+fuse:a/b+var:c/d")
        return (name, *named[name], variants.enabled())
    on, fuse, var = False, (), variants.enabled()
    for part in body.split("+"):
        key, _, val = part.partition(":")
        if key == "pdl":
            on = val == "1"
        elif key == "fuse":
            fuse = _names(val, fusions.ALL)
        elif key == "var":
            var = _names(val, variants.ALL)
        else:
            raise ValueError(f"config {spec!r}: parts are pdl:0|1, fuse:LIST and var:LIST")
    fusions.parse(",".join(fuse))  # validates the names
    fusions.parse(",".join(var), variants.ALL, "kernel variants")
    return name, on, fuse, var


def parse_configs(specs: str) -> list[tuple[str, bool, tuple[str, ...], tuple[str, ...]]]:
    """A comma list of configs; "each" stands for one config per fusion (that fusion alone on today's step)."""
    names = [c for c in specs.split(",") if c]
    return [parse_config(c) for n in names for c in (fusions.ALL if n == "each" else (n,))]


def apply(on: bool, fuse: tuple[str, ...], var: tuple[str, ...]) -> None:
    pdl.set_enabled(on)
    fusions.set_fusions(fuse)
    variants.set_variants(var)


def recapture(runner, size: int) -> None:
    """The decode graph of one bucket captured again (the runner's own capture, a fresh memory pool; on the
    CPU its static batch, run eagerly)."""
    runner.graphs.pop(size, None)
    if not torch.cuda.is_available():
        runner.static_decode_batches([size])
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    runner._capture([size], torch.cuda.graph_pool_handle())


def eager_forward(runner, size: int) -> tuple[int | None, torch.Tensor]:
    """One eager decode forward of the bucket's static batch (what its graph holds): the CUDA kernels it
    launches (torch profiler; None without CUPTI or on the CPU) and its logits (the same input under every
    switch set: they must agree within bf16 rounding)."""
    from torch.profiler import ProfilerActivity, profile

    batch = runner.graphs[size].batch
    logits = runner.model(batch, runner.cache).float().clone()  # also warms: no first-call allocations counted
    if not torch.cuda.is_available():
        return None, logits
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.model(batch, runner.cache)
            torch.cuda.synchronize()
    except Exception as e:  # no CUPTI: the CPU count (tools.count_decode_ops) stands
        print(f"  kernel count unavailable: {type(e).__name__}: {e}", flush=True)
        return None, logits
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
               and "Memset" not in e.name), logits


def time_steps(eng, steps: int) -> float:
    for _ in range(4):
        eng.step()
    eng.flush()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    eng.flush()
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def run(engine_args: dict, batches: list[int], configs: list[tuple[str, bool, tuple[str, ...], tuple[str, ...]]],
        input_len: int, steps: int, single_batches: set[int] | None = None) -> list[dict]:
    """single_batches: where the one-fusion configs (named after their fusion) run; None: every batch."""
    start_variants = variants.enabled()
    llm = LLM(**engine_args)
    eng = llm.engine
    runner, layers = eng.runner, eng.cfg.num_layers
    rows, first_logits = [], None
    for b in batches:
        size = min((s for s in runner.graphs if s >= b), default=b)  # the CPU: no graphs, a static batch of b
        sp = SamplingParams(max_tokens=len(configs) * (steps + 8) + 16, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(random_prompts(b, input_len, eng.cfg.vocab_size, seed=b)):
            eng.add_request(GenerationRequest(f"switch-{b}-{i}", prompt_token_ids=prompt, sampling=sp))
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        eng.flush()
        for name, on, fuse, var in configs:
            if single_batches is not None and name in fusions.ALL and b not in single_batches:
                continue
            apply(on, fuse, var)
            try:
                recapture(runner, size)
                count, diff = None, None
                if b == batches[0]:
                    count, logits = eager_forward(runner, size)
                    first_logits = logits if first_logits is None else first_logits
                    diff = ((logits - first_logits).abs().max() / first_logits.abs().max()).item()
                ms = time_steps(eng, steps)
            except Exception as e:  # a config that fails is reported; the others still run
                print(f"  batch {b} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"batch": b, "config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                eng.flush()
                continue
            row = {"batch": b, "config": name, "pdl": on, "fusions": list(fuse), "variants": list(var), "step_ms": ms}
            if count is not None:
                row |= {"kernels_per_step": count, "kernels_per_layer": count / layers}
            extra = f", {count} kernels ({count / layers:.1f} per layer)" if count is not None else ""
            if diff is not None:  # the bf16 tolerance of tests/engine/test_kernels_on_off.py
                row |= {"logits_rel_diff": diff, "logits_ok": diff <= LOGITS_TOL}
                extra += f", logits vs {configs[0][0]}: {diff:.1e}" + ("" if diff <= LOGITS_TOL else " MISMATCH")
            rows.append(row)
            print(f"  batch {b:>3} {name:<16} {ms:7.2f} ms/step{extra}", flush=True)
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.flush()
    apply(False, (), start_variants)
    return rows


def share_floors(engine_args: dict, batches: list[int], preset: str, experts: int, quant: str, world: int) -> dict:
    """Builds rank 0's share (tools.bench_tp_share.share_model), points engine_args at it (with the KV pool
    tools.bench_tp_share gives it on the GPU) and returns its floors per batch (none on the CPU)."""
    cuda = torch.cuda.is_available()
    folder, model, cfg, tp = share_model(preset, experts, quant, world, "cuda" if cuda else "cpu")
    engine_args["model"] = str(folder)
    if not cuda:
        return {}
    engine_args.setdefault("kv_cache_memory_bytes", 16 << 30)
    bandwidth = copy_bandwidth()
    return {b: {**share_floor(model, cfg, tp, b, bandwidth), "head_ms": 0.0, "num_layers": cfg.num_layers}
            for b in batches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help='a checkpoint ("": the tiny default, a CPU smoke run)')
    ap.add_argument("--tp-share", type=int, default=0, help="time rank 0's share at this tensor_parallel_size instead")
    ap.add_argument("--experts", type=int, default=256, help="--tp-share: routed experts of the whole model")
    ap.add_argument("--preset", default="flash-depth", help="--tp-share: the model's shape (a random_checkpoint preset)")
    ap.add_argument("--quant", default="fp8-fp4", help="--tp-share: the stored formats (the CPU runs bf16)")
    ap.add_argument("--batches", default="1,32,150")
    ap.add_argument("--configs", default="pdl,base,all,each", help='comma list; "each": every fusion alone')
    ap.add_argument("--single-batches", default="1,150", help="batches the one-fusion configs run at (all: every one)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--engine-args", default=DEPTH)
    ap.add_argument("--label", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if (a.model is None) == (a.tp_share == 0):
        ap.error("give --model or --tp-share, one of them")
    configs = parse_configs(a.configs)
    apply(False, (), variants.enabled())
    batches = [int(b) for b in a.batches.split(",")]
    engine_args = {"model": a.model, **json.loads(a.engine_args)}
    if a.tp_share:
        floors = share_floors(engine_args, batches, a.preset, a.experts, a.quant, a.tp_share)
    else:
        floors = {f["batch"]: f for f in decode_floors(engine_args, batches)} if torch.cuda.is_available() else {}
    singles = None if a.single_batches == "all" else {int(b) for b in a.single_batches.split(",") if b}
    rows = run(engine_args, batches, configs, a.input_len, a.steps, singles)
    base = {r["batch"]: r["step_ms"] for r in rows if r["config"] == configs[0][0] and "step_ms" in r}
    print(f"{'batch':>5} {'config':<16} {'ms/step':>8} {'x floor':>8} {'vs ' + configs[0][0]:>9} {'per layer':>10}")
    for r in rows:
        if "step_ms" not in r:
            continue
        f = floors.get(r["batch"], {"floor_ms": float("nan"), "head_ms": 0.0, "num_layers": 1})
        r["floor_ms"], r["x_floor"] = f["floor_ms"], r["step_ms"] / f["floor_ms"]
        r["layer_ms"] = (r["step_ms"] - f["head_ms"]) / f["num_layers"]
        r["speedup"] = base.get(r["batch"], r["step_ms"]) / r["step_ms"]
        print(f"{r['batch']:>5} {r['config']:<16} {r['step_ms']:8.2f} {r['x_floor']:7.2f}x {r['speedup']:8.3f}x "
              f"{r['layer_ms']:9.3f} ms" + (f"  {r['kernels_per_layer']:.1f} kernels/layer"
                                           if "kernels_per_layer" in r else ""))
    if a.json:
        share = {"world": a.tp_share, "experts": a.experts, "preset": a.preset} if a.tp_share else None
        meta = {"label": a.label, "engine_args": engine_args, "tp_share": share, "machine": platform.platform(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "argv": vars(a)}
        Path(a.json).write_text(json.dumps({"meta": meta, "floors": list(floors.values()), "rows": rows}, indent=1,
                                           default=str))
    return 1 if any("error" in r or not r.get("logits_ok", True) for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
