"""The sampled rows' draw on the GPU: K.sample_draw's kernels (one program a row, kernels/fused_draw.py; a row over
many programs, kernels/fused_draw_wide.py) against their torch reference (the same tokens and cuts but where rounding
decides) and all timed as CUDA-graph replays (the launches' own time, as in a captured step), at V4-Flash's vocabulary,
per batch and sampling options.

    python -m tools.bench_sample_draw [--batches 1 4 8 16 32 150] [--vocab 129280] [--sweep] [--json F]
--sweep: also the kernel's sizes (block, search block, probes, cap, warps) on top-p and top-k + top-p at the fewest
and the most rows, each checked as above.
On a machine without CUDA it runs on the CPU (Triton's interpreter; --small: the search's small sizes), a check of
the tool, not a timing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels import reference as ref
from kernels.fused_draw import sample_draw_fused
from kernels.fused_draw_wide import sample_draw_wide

OPTIONS = {  # name: (temperature, top_k, top_p, min_p)
    "temperature": (0.8, None, None, None),
    "top_p 0.95": (0.8, None, 0.95, None),
    "top_k 50": (0.8, 50, None, None),
    "top_k 50 + top_p 0.9": (0.8, 50, 0.9, None),
    "min_p 0.05": (0.8, None, None, 0.05),
}


SMALL = dict(block=64, search_block=16, probes=2, cap=8)
WIDE_SMALL = dict(segment=64, block=32, search_block=16, probes=2, passes=1, cap=8)
SWEEP = [dict(block=b, search_block=sb, probes=p, cap=c, num_warps=w) for b, sb, p, c, w in
         ((4096, 256, 8, 2048, 8), (2048, 128, 8, 1024, 8), (2048, 128, 4, 1024, 8), (2048, 128, 4, 1024, 4),
          (2048, 256, 16, 1024, 8), (1024, 64, 4, 512, 4), (4096, 512, 8, 2048, 16))]


def _rows(n: int, vocab: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    """LM-like rows: a few likely tokens over a long tail, in bf16 as the lm_head stores them (ties happen)."""
    logits = (torch.randn(n, vocab, device=dev, generator=g) * 2.5).bfloat16().float()
    logits[:, :8] += torch.rand(n, 8, device=dev, generator=g) * 12
    return logits


def _time(fn, reps: int = 20) -> float:
    """ms a call: replays of a CUDA graph of it on the GPU (eager calls timed by events where capture fails), the
    wall clock once on the CPU."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
    except RuntimeError as e:  # the eager calls then, launch gaps and all
        print(f"  (not captured: {str(e).splitlines()[0][:80]})")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _agreement(got, cuts, want, keep, d, min_p) -> tuple[float, float]:
    """Shares of rows with the reference's token and the reference's kept set (from the kernel's cut)."""
    kept = (d > float("-inf")) & (d >= cuts[:, None])
    if min_p is not None:
        kept &= d.exp() >= min_p[:, None]
    return (got == want).float().mean().item(), (kept == keep).all(-1).float().mean().item()


def sweep(dev: torch.device, vocab: int, g: torch.Generator, batches: list[int], only: dict | None) -> list[dict]:
    """The kernel's sizes (only: just that one, the CPU check) on top-p 0.95 and top-k 50 + top-p 0.9, at the
    fewest and the most rows of `batches`."""
    out = []
    print(f"{'batch':>5} {'options':<22} {'block/sb/probes/cap/warps':<26} {'ms':>7} {'same tok':>9}")
    for n in sorted({min(batches), max(batches)}):
        logits = _rows(n, vocab, dev, g)
        rows = torch.arange(n, device=dev)
        u = torch.rand(n, dtype=torch.float64, device=dev, generator=g)
        temp = torch.full((n,), 0.8, device=dev)
        for name, top_k, top_p in (("top_p 0.95", None, 0.95), ("top_k 50 + top_p 0.9", 50, 0.9)):
            args = (logits, rows, temp, torch.full((n,), top_k, device=dev, dtype=torch.long) if top_k else None,
                    torch.full((n,), top_p, device=dev), None, u)
            want = ref.sample_draw(*args)
            for sizes in [only] if only else SWEEP:
                same = (sample_draw_fused(*args, **sizes) == want).float().mean().item()
                ms = _time(lambda: sample_draw_fused(*args, **sizes))
                label = "/".join(str(sizes.get(k, "-")) for k in ("block", "search_block", "probes", "cap",
                                                                    "num_warps"))
                print(f"{n:>5} {name:<22} {label:<26} {ms:>7.3f} {same:>9.3f}")
                out.append(dict(batch=n, options=name, sizes=sizes, kernel_ms=ms, same_token=same))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 150])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--small", action="store_true", help="the search's small sizes (a CPU check of the tool)")
    ap.add_argument("--sweep", action="store_true", help="also the kernel's sizes at the fewest and most rows")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, wide_sizes = (SMALL, WIDE_SMALL) if a.small else ({}, {})
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    print(f"{'batch':>5} {'options':<22} {'torch ms':>9} {'kernel ms':>9} {'wide ms':>8} {'best x':>7} "
          f"{'same tok':>9} {'same cut':>9} {'wide tok':>9} {'wide cut':>9}")
    for n in a.batches:
        logits = _rows(n, a.vocab, dev, g)
        rows = torch.arange(n, device=dev)
        u = torch.rand(n, dtype=torch.float64, device=dev, generator=g)
        for name, (t, k, p, m) in OPTIONS.items():
            temp = torch.full((n,), t, device=dev)
            top_k = torch.full((n,), k, device=dev, dtype=torch.long) if k else None
            top_p = torch.full((n,), p, device=dev) if p else None
            min_p = torch.full((n,), m, device=dev) if m else None
            args = (logits, rows, temp, top_k, top_p, min_p, u)
            want = ref.sample_draw(*args)
            d, keep = ref.sample_filter(logits, temp, top_k, top_p, min_p)
            cuts, wide_cuts = torch.empty(n, device=dev), torch.empty(n, device=dev)
            same_tok, same_cut = _agreement(sample_draw_fused(*args, cuts=cuts, **sizes), cuts, want, keep, d, min_p)
            wide_tok, wide_cut = _agreement(sample_draw_wide(*args, cuts=wide_cuts, **wide_sizes), wide_cuts, want,
                                            keep, d, min_p)
            t_ref = _time(lambda: ref.sample_draw(*args))
            t_ker = _time(lambda: sample_draw_fused(*args, **sizes))
            t_wide = _time(lambda: sample_draw_wide(*args, **wide_sizes))
            print(f"{n:>5} {name:<22} {t_ref:>9.3f} {t_ker:>9.3f} {t_wide:>8.3f} {t_ref / min(t_ker, t_wide):>6.1f}x "
                  f"{same_tok:>9.3f} {same_cut:>9.3f} {wide_tok:>9.3f} {wide_cut:>9.3f}")
            rows_out.append(dict(batch=n, options=name, torch_ms=t_ref, kernel_ms=t_ker, wide_ms=t_wide,
                                 same_token=same_tok, same_cut=same_cut, wide_same_token=wide_tok,
                                 wide_same_cut=wide_cut))
    if a.sweep:
        rows_out += sweep(dev, a.vocab, g, a.batches, SMALL if a.small else None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"vocab": a.vocab, "rows": rows_out, "device": torch.cuda.get_device_name() if dev.type == "cuda"
                       else "cpu (interpreter)"}, f, indent=1)
    return rows_out


if __name__ == "__main__":
    main()
