"""Per-op benchmark of the fused kernels (run on a GPU; a script, not a test).

For each op at V4-Flash shapes and several batch sizes: time of the fused kernel, of the
torch reference in eager mode and under torch.compile, and the fused kernel's achieved
bandwidth against the measured copy ceiling (or FLOP/s against the bf16 matmul ceiling).
Prints a table, writes JSON.

    python -m tools.bench_kernels [--batches 1,8,32,128,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kernels import fused, reference

COPY_TBS, MATMUL_TFLOPS = None, None


def time_ms(fn, iters: int = 30) -> float:
    """Median ms over iters, CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    copy_tbs = 2 * x.numel() / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ a)
    return copy_tbs, 2 * 8192**3 / (ms * 1e-3) / 1e12


def cases(B: int):
    """(name, fused fn, reference fn, args, bytes moved at least, flops)."""
    dev, bf = "cuda", torch.bfloat16
    D, H, hd, E, k, I = 4096, 64, 512, 256, 6, 2048
    x = torch.randn(B, D, device=dev, dtype=bf)
    w = torch.rand(D, device=dev) + 0.5
    yield "rms_norm", fused.rms_norm_fused, reference.rms_norm, (x, w, 1e-6), 2 * B * D * 2, 0
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=dev).float() / 64))
    cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (B,), device=dev), inv, bf)
    qh = torch.randn(B, H, hd, device=dev, dtype=bf)
    yield ("q norm + rope (64 x 512)", fused.norm_rope_fused, reference.norm_rope, (qh, None, cos, sin, 1e-6),
           2 * B * H * hd * 2, 0)
    kvp = torch.randn(4096, 128, hd, device=dev, dtype=bf)
    slots = torch.randperm(4096 * 128, device=dev)[:B]
    kvx = torch.randn(B, hd, device=dev, dtype=bf)
    yield ("kv norm + rope + cache insert", lambda *a: (fused.kv_norm_rope_insert_fused(*a), kvp.view(-1, hd)[slots])[1],
           lambda *a: (reference.kv_norm_rope_insert(*a), kvp.view(-1, hd)[slots])[1],
           (kvx, torch.rand(hd, device=dev) + 0.5, cos, sin, 1e-6, kvp, slots), 2 * B * hd * 2, 0)
    h4 = torch.randn(B, 4, D, device=dev, dtype=bf)
    fn, base, scale = torch.randn(24, 4 * D, device=dev) * 0.02, torch.randn(24, device=dev) * 0.1, torch.rand(3, device=dev)
    yield ("hc_pre", fused.hc_pre_fused, reference.hc_pre, (h4, fn, base, scale, 1e-6, 1e-6, 20),
           B * 4 * D * 2 + 24 * 4 * D * 4 + B * D * 2, 2 * B * 24 * 4 * D)
    post, comb = torch.rand(B, 4, device=dev), torch.rand(B, 4, 4, device=dev)
    yield "hc_post", fused.hc_post_fused, reference.hc_post, (h4, x, post, comb), 2 * B * 4 * D * 2 + B * D * 2, 0
    gw, gb = torch.randn(E, D, device=dev, dtype=bf), torch.randn(E, device=dev) * 0.1
    yield ("router_topk", fused.router_topk_fused, reference.router_topk, (x, gw, gb, k, 1.5, "sqrtsoftplus"),
           E * D * 2 + B * D * 2, 2 * B * E * D)
    # decode attention: B sequences at position 1023 (window 128 + 256 CSA entries, top-512 selects all)
    bs, L, ratio = 256, 1024, 4
    nblk = B * (L // bs)
    window = torch.randn(nblk, bs, hd, device=dev, dtype=bf)
    comp = torch.randn(nblk, bs // ratio, hd, device=dev, dtype=bf)
    tables = torch.arange(nblk, device=dev).view(B, L // bs)
    q = torch.randn(B, H, hd, device=dev, dtype=bf)
    pos = torch.full((B,), L - 1, device=dev)
    seq = torch.arange(B, device=dev)
    sel = torch.arange(L // ratio, device=dev).repeat(B, 1)
    sel = torch.cat([sel, torch.full((B, 512 - L // ratio), -1, device=dev)], 1)
    sinks = torch.randn(H, device=dev)
    keys = 128 + L // ratio
    yield ("paged_attention (CSA decode, ctx 1024)", fused.paged_attention_fused, reference.paged_attention,
           (q, pos, seq, window, tables, torch.zeros(B, dtype=torch.long, device=dev), 128, comp, tables, ratio, sel,
            sinks, hd**-0.5), B * (keys * hd * 2 + 2 * H * hd * 2), 4 * B * H * keys * hd)
    E16 = 16
    w1 = torch.randn(E16, I, D, device=dev, dtype=bf) * 0.02
    w3, w2 = torch.randn_like(w1), torch.randn(E16, D, I, device=dev, dtype=bf) * 0.02
    idx = torch.stack([torch.randperm(E16, device=dev)[:k] for _ in range(B)])
    rw = torch.rand(B, k, device=dev, dtype=bf)
    touched = min(E16, B * k)
    yield ("moe_experts (16 experts, top-6)", fused.moe_experts_fused, reference.moe_experts,
           (x, w1, w3, w2, rw, idx, 10.0), touched * 3 * I * D * 2, 2 * 3 * B * k * I * D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128,256", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    copy_tbs, mm_tflops = ceilings()
    print(f"ceilings: copy {copy_tbs:.2f} TB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s ({torch.cuda.get_device_name()})")
    rows = []
    for B in a.batches:
        for name, fz, rf, args, nbytes, flops in cases(B):
            got, want = fz(*args), rf(*args)
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            if name.startswith("router"):  # same experts, order free
                got, want = (got[0].sort(-1).values, got[1].sort(-1).values), (want[0].sort(-1).values, want[1].sort(-1).values)
            err = max(((g.float() - w.float()).norm() / max(w.float().norm(), 1e-12)).item() for g, w in zip(got, want))
            t_f = time_ms(lambda f=fz, x=args: f(*x))
            t_e = time_ms(lambda f=rf, x=args: f(*x))
            t_c = float("nan")
            if not a.no_compile:
                try:
                    cf = torch.compile(rf, dynamic=False)
                    t_c = time_ms(lambda f=cf, x=args: f(*x))
                except Exception as e:  # noqa: BLE001 - data-dependent references do not compile
                    print(f"  torch.compile {name}: {type(e).__name__}")
            floor_ms = max(nbytes / (copy_tbs * 1e12), flops / (mm_tflops * 1e12)) * 1e3
            rows.append({"op": name, "batch": B, "rel_err": err, "fused_ms": t_f, "eager_ms": t_e, "compile_ms": t_c,
                         "speedup_vs_eager": t_e / t_f, "floor_ms": floor_ms, "of_floor": floor_ms / t_f,
                         "GB_s": nbytes / (t_f * 1e-3) / 1e9, "TFLOP_s": flops / (t_f * 1e-3) / 1e12})
    hdr = f"{'op':42} {'B':>4} {'rel err':>8} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} {'x eager':>8} {'floor ms':>9} {'% floor':>8} {'GB/s':>8} {'TFLOP/s':>8}"
    print(hdr)
    for r in rows:
        print(f"{r['op']:42} {r['batch']:>4} {r['rel_err']:>8.1e} {r['fused_ms']:>9.4f} {r['eager_ms']:>9.4f} {r['compile_ms']:>10.4f} "
              f"{r['speedup_vs_eager']:>8.2f} {r['floor_ms']:>9.4f} {100 * r['of_floor']:>7.1f}% {r['GB_s']:>8.0f} "
              f"{r['TFLOP_s']:>8.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_TB_s": copy_tbs, "matmul_TFLOP_s": mm_tflops,
                       "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
