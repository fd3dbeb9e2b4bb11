"""Where a decode step's time goes (GPU): profile a batch-1 generation that is almost all decode
and print the kernels by total CUDA time.

    python -m tools.profile_decode [--model DIR | --preset flash-shaped | v41-flash-shaped] [--batch 1] [--steps 200] [--host]
        [--engine-args '{"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}']
    python -m tools.profile_decode --tp-share 8 --experts 256 --preset flash-depth --quant fp8-fp4 ...

--tp-share N: rank 0's share of the preset at tensor_parallel_size N instead of a checkpoint, built in memory with the
collectives skipped (tools.bench_tp_share.share_model).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.models.deepseek_v41.random_checkpoint import PRESETS as V41_PRESETS
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from engine.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="flash-shaped")
    ap.add_argument("--cache-dir", default="/tmp/ckpt")
    ap.add_argument("--quant", default="bf16", help="the preset's weights as stored (random_checkpoint.QUANTS)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--prompt-len", type=int, default=16, help="long prompts profile the prefill steps too")
    ap.add_argument("--host", action="store_true", help="profile the host (cProfile) instead of the GPU kernels")
    ap.add_argument("--ops", action="store_true", help="also the torch ops by the CUDA time of their kernels, with "
                    "input shapes (which op launched an anonymous elementwise or copy kernel)")
    ap.add_argument("--engine-args", default="{}", help="JSON over the defaults below (e.g. a speculative_config)")
    ap.add_argument("--tp-share", type=int, default=0, help="profile rank 0's share at this tensor_parallel_size")
    ap.add_argument("--experts", type=int, default=256, help="--tp-share: routed experts of the whole model")
    a = ap.parse_args()
    model = a.model
    if a.tp_share:
        from tools.bench_tp_share import share_model

        model = str(share_model(a.preset, a.experts, a.quant, a.tp_share, "cuda")[0])
    elif model is None:
        model = str(Path(a.cache_dir) / (a.preset if a.quant == "bf16" else f"{a.preset}-{a.quant}"))
        if not (Path(model) / "config.json").exists():
            if a.preset in V41_PRESETS:
                write_v41_checkpoint(model, a.preset, device="cuda", quant=a.quant)
            else:
                write_checkpoint(model, a.preset, device="cuda", quant=a.quant)
    args = dict(max_model_len=4096, max_num_seqs=max(64, a.batch), block_size=128, gpu_memory_utilization=0.85)
    llm = LLM(model, **{**args, **json.loads(a.engine_args)})
    sp = SamplingParams(max_tokens=a.steps, temperature=0, ignore_eos=True)
    prompts = [[5 + (i * 31 + j * 7) % 4000 for j in range(a.prompt_len)] for i in range(a.batch)]
    # warm on other prompts: the same ones would hit the prefix cache and profile a replay, not a prefill
    warm = [[5 + (i * 37 + j * 11 + 1) % 4000 for j in range(a.prompt_len)] for i in range(a.batch)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    if a.host:  # where the Python time of a step goes (graph replay included, GPU waits included)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(llm.generate, prompts, sp)
        wall = time.perf_counter() - t0
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.rows)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("engine/", a.rows)  # the engine's own calls
        print(f"wall time per output token under cProfile: {wall / a.steps * 1e3:.3f} ms (batch {a.batch}); "
              f"{(llm.engine.spec.stats(), llm.engine.spec.step_paths) if llm.engine.spec else ''}")
        return
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=a.ops) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60)
    print(table)
    if a.ops:
        ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
        ops.sort(key=lambda e: e.device_time_total, reverse=True)
        print("torch ops by CUDA time (their kernels counted in; nested ops count twice):")
        for e in ops[:a.rows]:
            print(f"  {e.device_time_total / 1e3:9.3f} ms  {e.count:6d} calls  {e.key:28s} {str(e.input_shapes)[:110]}")
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    print(f"CUDA kernel time per step, the prefill counted in: {total / a.steps / 1e3:.3f} ms (batch {a.batch}, prompts of "
          f"{a.prompt_len}); wall time per step under the profiler: {wall / a.steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
