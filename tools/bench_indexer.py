"""The lightning indexer's selection at decode, one CSA layer's call: today's path (kernels.fused_indexer: every
entry of a row scored, then a sort up to 4,096 entries or torch.topk past it) against the kernel variant
indexer_select (kernels.indexer_select: each token scores what it sees and sorts those, or past 2,048 of them
radix-selects its top-k), at the row widths a decode graph gives them (max_model_len / ratio: 8K, 128K and 1M
positions are rows of 2,048, 32,768 and 262,144 entries) and the contexts the tokens see. V4-Flash's indexer (64 heads of 128, top-512, ratio 4), bf16 keys
in 128-position blocks of a shared pool read through random tables. Each pair of paths checked to pick the same set;
each timed as 8 calls in one CUDA graph (as a decode graph runs it). Prints a table, writes JSON rows.

    python -m tools.bench_indexer [--tokens 1,32,150] [--widths 2048,32768,262144] [--contexts 1024,8192,65536]
                                  [--prefill 2048,8192,32768] [--json out.json]

--prefill: also a prefill chunk's call: the last 2,048 tokens of one sequence of that many positions, rows as wide
as the sequence's entries (an eager prefill sizes them so), each token seeing its own prefix.

Without a GPU it runs under Triton's interpreter on the CPU on a scaled-down indexer (`--small`): the checks and the
table, not the timings.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tools.kernel_device import call_timer, exit_status, gpu_or_interpreter

RATIO, BLOCK = 4, 128  # V4-Flash's CSA compression and the cache's positions a block


def _compare(args: tuple, heads: int, timed, *paths) -> tuple[bool, list[float]]:
    """Whether the paths pick the same set for every token, and each one's microseconds a call."""
    picks = [f(*args, iw_scale=heads**-0.5).sort(dim=1).values for f in paths]
    same = all(torch.equal(picks[0], p) for p in picks[1:])
    return same, [timed(lambda f=f: f(*args, iw_scale=heads**-0.5)) for f in paths]


def _row(tokens: int, width: int, context: int, us: list[float], same: bool, kind: str = "decode") -> dict:
    print(f"{kind:>7} | {tokens:>6} | {width:>9} | {context:>7} | {us[0]:>10.1f} | {us[1]:>17.1f} | "
          f"{us[0] / us[1]:>13.2f}x" + ("" if same else "  MISMATCH"), flush=True)
    return {"kind": kind, "tokens": tokens, "width": width, "context": context, "today_us": us[0], "select_us": us[1],
            "same_set": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_indexer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,32,150", help="decode tokens a call (one sequence each)")
    ap.add_argument("--widths", default="2048,32768,262144", help="entries a row (max_model_len / 4)")
    ap.add_argument("--contexts", default="1024,8192,65536", help="positions each token's sequence holds")
    ap.add_argument("--prefill", default="2048,8192,32768", help="prompt lengths whose last chunk is timed")
    ap.add_argument("--chunk", type=int, default=2048, help="a prefill chunk's tokens")
    ap.add_argument("--small", action="store_true", help="8 heads of 16, top-8: the CPU's interpreter run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = gpu_or_interpreter()  # before the kernels' modules load
    from kernels.fused_indexer import indexer_topk_fused
    from kernels.indexer_select import indexer_topk_select

    heads, dim, topk = (8, 16, 8) if a.small else (64, 128, 512)
    per_block = BLOCK // RATIO
    timed = call_timer(dev.type == "cuda", calls=8)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, failures = [], []
    print("   call | tokens | row width | context | today's us | indexer_select us | today / select", flush=True)
    for width in (int(w) for w in a.widths.split(",") if w):
        pool_blocks = min(4096, width // per_block + 1)
        pool = torch.randn(pool_blocks, per_block, dim, device=dev, generator=g).bfloat16()
        for tokens in (int(t) for t in a.tokens.split(",") if t):
            tables = torch.randint(0, pool_blocks, (tokens, width // per_block + 1), device=dev, generator=g)
            iq = torch.randn(tokens, heads, dim, device=dev, generator=g).bfloat16()
            iw = torch.randn(tokens, heads, device=dev, generator=g).bfloat16()
            seq = torch.arange(tokens, device=dev)
            for context in (int(c) for c in a.contexts.split(",") if c):
                if context // RATIO > width:
                    continue
                pos = torch.full((tokens,), context - 1, device=dev)
                args = (iq, iw, pool, tables, pos, seq, RATIO, topk, width * RATIO - 1)
                same, us = _compare(args, heads, timed, indexer_topk_fused, indexer_topk_select)
                if not same:
                    failures.append(f"{tokens} tokens, width {width}, context {context}: the sets differ")
                rows.append(_row(tokens, width, context, us, same))
    for context in (int(c) for c in a.prefill.split(",") if c):
        width, tokens = context // RATIO, min(a.chunk, context)
        pool_blocks = width // per_block + 1
        pool = torch.randn(pool_blocks, per_block, dim, device=dev, generator=g).bfloat16()
        table = torch.randperm(pool_blocks, device=dev, generator=g)[None]
        iq = torch.randn(tokens, heads, dim, device=dev, generator=g).bfloat16()
        iw = torch.randn(tokens, heads, device=dev, generator=g).bfloat16()
        pos = torch.arange(context - tokens, context, device=dev)
        args = (iq, iw, pool, table, pos, torch.zeros_like(pos), RATIO, topk, context - 1)
        same, us = _compare(args, heads, timed, indexer_topk_fused, indexer_topk_select)
        if not same:
            failures.append(f"prefill chunk of {tokens} at {context} positions: the sets differ")
        rows.append(_row(tokens, width, context, us, same, "prefill"))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       "heads": heads, "dim": dim, "topk": topk, "rows": rows}, fh, indent=1)
    return exit_status("bench_indexer", failures)


if __name__ == "__main__":
    sys.exit(main())
