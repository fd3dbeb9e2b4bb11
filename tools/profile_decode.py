"""Where a decode step's time goes (GPU): profile a batch-1 generation that is almost all decode
and print the kernels by total CUDA time.

    python -m tools.profile_decode [--model DIR | --preset flash-shaped] [--batch 1] [--steps 200]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from backend.engine.llm import LLM
from backend.engine.request import SamplingParams
from tools.make_tiny_checkpoint import write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="flash-shaped")
    ap.add_argument("--cache-dir", default="/tmp/ckpt")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    model = a.model
    if model is None:
        model = str(Path(a.cache_dir) / a.preset)
        if not (Path(model) / "config.json").exists():
            write_checkpoint(model, a.preset, device="cuda")
    llm = LLM(model, max_model_len=4096, max_num_seqs=64, block_size=128, gpu_memory_utilization=0.5)
    sp = SamplingParams(max_tokens=a.steps, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * 16 for i in range(a.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, sp)
    torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60)
    print(table)
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    print(f"CUDA kernel time per decode step: {total / a.steps / 1e3:.3f} ms (batch {a.batch})")


if __name__ == "__main__":
    main()
