"""The fused paged attention at prefill (kernels/fused_attention.py): one sequence's chunk of T query tokens at
positions [P, P + T) with V4-Flash's heads (64 x 512, shared KV), the 128-token window and either the CSA branch
(ratio 4, the indexer's 512 picks per token) or the HCA branch (ratio 128, every complete entry); a sweep of
the launch's tiles of both kinds (the small tiles: heads per program, keys per step, warps; the wgmma tiles: the same
plus output columns per program and pipeline stages), each checked
against the default tiles (which the tests hold to the reference; here the default is checked against the reference
once) and timed in CUDA-graph replays, next to the FLOP floor. Prints a table (best last), writes JSON.

On the CSA branch the wgmma tiles are timed again with the kernel variant attn_offsets (each slot's key row read
from a table written once a call). Then the default dispatch (the 2048-token chunk and decode batches of --decode
tokens) and, --against MODULE, another implementation of paged_attention_fused (an older kernel, say) at the same
sizes, checked against each other.

    python -m tools.bench_attention_prefill [--tokens 2048] [--start 2048] [--only wgmma] [--decode 1,32,150]
        [--against tools._old_attention] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

import torch

from tools.kernel_device import finish, graph_time

H, HD, W, BS, TOPK = 64, 512, 128, 128, 512
PEAK_BF16 = 790e12
# the small tiles (heads per program, keys per step, warps): the former three-loop kernel's best at prefill
SMALL_TILES = ((32, 32, 4),)
# the wgmma tiles (+ output columns per program, pipeline stages): a sweep's best and runners-up
# (of 11: docs/perf/h200-2026-12-03-s11/attention_sweep_first.log)
WGMMA_TILES = ((64, 64, 8, 512, 2), (64, 32, 8, 512, 3), (64, 32, 8, 256, 3), (32, 32, 4, 512, 3))


def _case(mode: str, T: int, start: int, dev):
    """Arguments of paged_attention_fused for one chunk; keys drawn at random, CSA picks drawn among the visible
    entries (valid first, -1 after, as indexer_topk returns them)."""
    g = torch.Generator(device=dev).manual_seed(T + start)
    L = start + T
    nblk = -(-L // BS)
    ratio = 4 if mode == "csa" else 128
    window = torch.randn(nblk, BS, HD, device=dev, generator=g).bfloat16()
    comp = torch.randn(nblk, BS // ratio, HD, device=dev, generator=g).bfloat16()
    tables = torch.arange(nblk, device=dev, dtype=torch.int32)[None]
    q = (torch.randn(T, H, HD, device=dev, generator=g) / 4).bfloat16()
    pos = torch.arange(start, L, device=dev)
    seq = torch.zeros(T, dtype=torch.long, device=dev)
    sel = None
    if mode == "csa":
        vis = (pos + 1) // ratio
        scores = torch.rand(T, L // ratio, device=dev, generator=g)
        scores = scores.masked_fill(torch.arange(L // ratio, device=dev)[None] >= vis[:, None], -1.0)
        top = scores.topk(min(TOPK, L // ratio), dim=1)
        sel = torch.where(top.values >= 0, top.indices, -1)
        sel = torch.nn.functional.pad(sel, (0, TOPK - sel.shape[1]), value=-1).int()
    sinks = torch.randn(H, device=dev, generator=g)
    args = (q, pos, seq, window, tables, torch.zeros(1, dtype=torch.long, device=dev), W, comp, tables, ratio, sel,
            sinks, HD**-0.5)
    keys = (torch.clamp(pos + 1, max=W) + (torch.clamp((pos + 1) // ratio, max=TOPK) if mode == "csa"
                                           else (pos + 1) // ratio)).sum().item()
    return args, 4 * H * HD * keys  # QK and PV, 2 FLOPs per multiply-add


def _sizes(mode: str, T: int, start: int, dev, other) -> tuple[list[dict], list[str]]:
    """At T tokens: the default dispatch, the small tiles (block_h 16 / 32, as the three-loop kernel decoded), the
    wgmma tiles at half and twice the default splits, and `other`'s attention, if given; each checked against the
    default: microseconds."""
    from kernels import fused_attention as fa

    args, _ = _case(mode, T, start, dev)
    ours = functools.partial(fa.paged_attention_fused, *args)
    want = ours().float()
    auto = fa.splits(T, wgmma=True)  # the default rule for the wgmma tiles (one head block of 64)
    cands = [("default", ours), ("small tiles", functools.partial(fa.paged_attention_fused, *args,
                                                                    block_h=32 if T >= 32 else 16))]
    if T < fa.PREFILL_T:
        tiles = fa.WGMMA_TILES
        cands += [(f"wgmma nsplit {n}", functools.partial(fa.paged_attention_fused, *args, wgmma_tiles=tiles,
                                                          nsplit=n)) for n in sorted({max(auto // 2, 1), auto * 2})]
    if other is not None:
        cands.append(("--against", functools.partial(other, *args)))
    rows, err = [], []
    for name, fn in cands:
        diff = (fn().float() - want).abs().max().item()
        us = graph_time([fn]) * 1e6
        rows.append({"mode": mode, "tokens": T, "start": start, "variant": name, "us": us, "diff_vs_default": diff})
        print(f"{mode} T={T} | {name} | {us:.1f} us | diff {diff:.1e}", flush=True)
        if diff > 2e-2:
            err.append(f"{mode} T={T} {name} vs the default: {diff:.3g}")
    return rows, err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_attention_prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--start", type=int, default=2048, help="the chunk's first position (tokens already cached)")
    ap.add_argument("--only", choices=("small", "wgmma"), default=None, help="one kind of tiles in the sweep")
    ap.add_argument("--decode", default="1,32,150", help="decode batch sizes timed with the default dispatch")
    ap.add_argument("--against", default=None, help="a module with another paged_attention_fused to time")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the timings are CUDA-graph replays)", file=sys.stderr)
        return 1
    from kernels import reference as ref
    from kernels import variants
    from kernels.fused_attention import paged_attention_fused

    dev, rows, bad, today = torch.device("cuda"), [], [], variants.enabled()
    for mode in ("csa", "hca"):
        args, flops = _case(mode, a.tokens, a.start, dev)
        base = paged_attention_fused(*args).float()
        small, _ = _case(mode, 256, a.start, dev)
        err = ((paged_attention_fused(*small).float() - ref.paged_attention(*small).float()).abs().max()).item()
        print(f"{mode}: default tiles vs the reference (256 tokens): max abs diff {err:.2e}", flush=True)
        if err > 2e-2:
            bad.append(f"{mode} default tiles vs the reference: {err:.3g}")
        floor = flops / PEAK_BF16 * 1e6
        cands = [("small", t, dict(nsplit=1, block_h=t[0], block_n=t[1], num_warps=t[2]), ()) for t in SMALL_TILES]
        cands += [("wgmma", t, dict(wgmma_tiles=t), ()) for t in WGMMA_TILES]
        if mode == "csa":  # the kernel variant attn_offsets: the slots' key rows read from one table (CSA only)
            cands += [("wgmma", t, dict(wgmma_tiles=t), ("attn_offsets",)) for t in WGMMA_TILES]
        for kernel, tile, kw, extra in cands:
            if a.only and kernel != a.only:
                continue
            name = f"{kernel} " + " ".join(f"{k}{v}" for k, v in zip("hnwds", tile)) + "".join(f" +{v}" for v in extra)
            fn = functools.partial(paged_attention_fused, *args, **kw)
            try:
                variants.set_variants((*today, *extra))
                diff = (fn().float() - base).abs().max().item()
                us = graph_time([fn]) * 1e6
            except Exception as e:  # noqa: BLE001 - a tile that does not fit the chip's shared memory or registers
                print(f"{mode} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            finally:
                variants.set_variants(today)
            rows.append({"mode": mode, "kernel": kernel, "tiles": list(tile), "name": name, "us": us,
                         "variants": list(extra), "floor_us": floor, "max_abs_diff_vs_default": diff,
                         "tokens": a.tokens, "start": a.start})
            if diff > 2e-2:
                bad.append(f"{mode} {name} vs the default tiles: {diff:.3g}")
            print(f"{mode} | {name} | {us:.1f} us | {floor / us:.1%} of FLOP peak | diff {diff:.1e}", flush=True)
    other = importlib.import_module(a.against).paged_attention_fused if a.against else None
    for mode in ("csa", "hca"):
        for T in [a.tokens] + [int(x) for x in a.decode.split(",") if x]:
            more, err = _sizes(mode, T, a.start, dev, other)
            rows += more
            bad += err
    for mode in ("csa", "hca"):
        sel = sorted((r for r in rows if r["mode"] == mode and "kernel" in r), key=lambda r: r["us"])
        if sel:
            b = sel[0]
            print(f"best {mode}: {b['name']} {b['us']:.1f} us "
                  f"(floor {b['floor_us']:.1f} us)", flush=True)
    return finish("bench_attention_prefill", rows, a.json, bad)


if __name__ == "__main__":
    sys.exit(main())
