"""One tensor-parallel rank's share of DeepSeek-V4.1-Flash at its released size, timed on one GPU (a
script, not a test): decode steps at batch 1 / 32 / 150 against the rank's floor, TTFT at 1K / 8K,
and the Engram gather from host memory: its time and how much of it the overlap hides.

    python -m tools.bench_v41_share [--worlds 4,8] [--experts 384] [--engram-vocab 16000000] \
        [--batches 1,32,150] [--ttft 1024,8192] [--json out.json]

The share is rank 0's at tensor_parallel_size N with expert parallelism (engine/models/deepseek_v41/shards.py):
num_heads / N heads and their output groups, 384 / N routed experts of the released width (2304) in
MXFP4, the shared expert's 1/N slice, FP8 32x32 linears as stored, the replicated compressors and
indexers, the LM head; and rank 0's rows of the two Engram tables at the released row count
(engram_vocab_size 16M: 384M rows a table; a rank holds 1/N of them, FP8 rows + a scale per 32
channels, ~25 GB at N = 8, ~50 GB at N = 4) in host RAM, gathered per step by host threads
(engine/models/deepseek_v41/engram_tables.py). --engram-vocab scales the tables down when the
host's RAM is smaller. Weights are drawn in place on the GPU in their stored formats (no
checkpoint on disk) and run by the real engine (scheduler, runner, decode CUDA graphs) with the
collectives skipped (TensorParallel.share_only): the compute a rank does between its all-reduces.

Floor: the bytes a decode step must read on this rank (weights as stored, the routed experts the
batch is expected to hit) over the measured copy bandwidth (tools/bench_engine.copy_bandwidth).
Engram: `gather ms` is the host threads' time per step (both tables), `exposed ms` the time the
step waited for it (prefill: only what the layers before each Engram layer did not cover; decode
graphs: all of it, their rows are gathered before the replay); hidden = 1 - exposed / gather.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

import engine.models.registry as registry
from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import write_tokenizer
from engine.models.deepseek_v41.config import load_config
from engine.models.deepseek_v41.engram_tables import HostTables, StoredTable
from engine.models.deepseek_v41.model import DeepseekV41, engram_hasher, hold_fp32_weights
from engine.models.deepseek_v41.random_checkpoint import FP8_TILE, build_text_config, write_v41_checkpoint
from engine.models.deepseek_v41.shards import table_span
from engine.models.stacked_linears import stack_linears
from engine.parallel import TensorParallel, check_parallel
from engine.request import GenerationRequest, SamplingParams
from tools.bench_engine import random_prompts, steady_step_ms
from tools.bench_tp_share import fill_random

RELEASED = {"n_routed_experts": 384, "engram_vocab_size": 16_000_000}


def write_config(out: Path, preset: str, experts: int, engram_vocab: int, quant: bool) -> Path:
    """config.json (V4.1-Flash's released shape: preset v41-flash-shaped) and the repository's
    tokenizer; no weights."""
    write_tokenizer(out)
    text = build_text_config(preset, out / "tokenizer.json",
                             {"n_routed_experts": experts, "engram_vocab_size": engram_vocab})
    full = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "torch_dtype": "bfloat16"}
    if quant:
        full["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "weight_block_size": [FP8_TILE, FP8_TILE], "expert_dtype": "fp4"}
    (out / "config.json").write_text(json.dumps(full))
    return out


@torch.no_grad()
def random_share(model_dir: Path, tp: TensorParallel, device: str) -> DeepseekV41:
    """Rank 0's modules with random weights in their stored formats; its Engram rows in host RAM."""
    cfg = load_config(model_dir)
    cuda = device == "cuda"
    with torch.device("meta"):
        model = DeepseekV41(cfg, quantized=cuda, fp8_linears=cuda, tp=tp, engram_on_device=False)
    model.to_empty(device=device)
    model.cast(torch.bfloat16)
    fill_random(model, cfg, device)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    model.engram_hasher = engram_hasher(cfg).to(device)
    model.engram_hasher.bind_tokenizer(model_dir / "tokenizer.json", cfg.vocab_size)
    model.host_hasher = engram_hasher(cfg)
    model.host_hasher.bind_tokenizer(model_dir / "tokenizer.json", cfg.vocab_size)
    if cuda:
        stack_linears(model)
    hold_fp32_weights(model)
    spans = {layer: table_span(cfg, layer, tp) for layer in cfg.engram_layer_ids}
    tables = {}
    for layer, (lo, hi) in spans.items():  # FP8 rows of ~1.0 (0x38), ue8m0 scales of 2^-7: finite, cheap to fill
        rows = torch.empty(hi - lo, cfg.engram_head_dim, dtype=torch.uint8)
        rows.fill_(0x38)
        scale = torch.full((hi - lo, cfg.engram_head_dim // 32), 120, dtype=torch.uint8)
        tables[layer] = StoredTable(rows.view(torch.float8_e4m3fn), scale)
    model.host_tables = HostTables(tables, spans, torch.bfloat16, torch.device(device), copy=False)
    return model.eval()


def floor_bytes(model: DeepseekV41, batch: int) -> float:
    """Bytes a decode step of `batch` rows reads on this rank: every weight as stored (scales too)
    but the routed experts no row is expected to pick, the embedding (a lookup) and the Engram tables."""
    cfg = model.cfg
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b is not None and n.endswith("scale"))]
    experts = sum(t.numel() * t.element_size() for n, t in named if ".experts_w" in n)
    other = sum(t.numel() * t.element_size() for n, t in named if ".experts_w" not in n and not n.startswith("embed"))
    return other + experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)


def engram_window(model: DeepseekV41, run) -> dict:
    """run() under a fresh count of the host tables' stats: gather and exposed ms per gather pair."""
    stats = model.host_tables.stats
    before = dict(stats)
    run()
    n = max(1, (stats["gathers"] - before["gathers"]) // len(model.cfg.engram_layer_ids))
    return {"gather_ms": (stats["gather_s"] - before["gather_s"]) / n * 1e3,
            "exposed_ms": (stats["waited_s"] - before["waited_s"]) / n * 1e3}


def ttft_ms(eng, length: int, reps: int = 2) -> float:
    """Wall ms from add to the first token of one `length`-token prompt (nothing cached), best of reps."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    for i, prompt in enumerate(random_prompts(reps, length, eng.cfg.vocab_size, seed=length)):
        sync()
        t = time.perf_counter()
        eng.add_request(GenerationRequest(f"ttft-{length}-{i}", prompt_token_ids=prompt,
                                          sampling=SamplingParams(max_tokens=1, temperature=0)))
        while not any(o.token_ids for o in eng.step()):
            pass
        sync()
        best = min(best, (time.perf_counter() - t) * 1e3)
        eng.flush()
    return best


def check_host_tables(device: str) -> dict:
    """Greedy streams and logprobs of a tiny V4.1 in the released formats (FP8 Engram rows) with its
    tables on the device, in host RAM and memory-mapped: decode steps replay CUDA graphs (the host
    tables' rows fed to them before each replay), prefills run eagerly (the gathers overlapped)."""
    path = write_v41_checkpoint(Path(tempfile.mkdtemp(prefix="v41-check-")), "v41-tiny", seed=0, device=device,
                                quant="fp8-fp4")
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    prompts = random_prompts(3, 300, 4000, seed=5)
    prompts = [p[:60 + 100 * i] for i, p in enumerate(prompts)]
    outs = {}
    for placement in ("device", "host", "mmap"):
        llm = LLM(model=str(path), engram_tables=placement, max_model_len=512, max_num_seqs=8, block_size=16,
                  cudagraph_mode="FULL_DECODE_ONLY", async_scheduling=False,
                  **({} if device == "cuda" else {"dtype": "float32"}))
        outs[placement] = llm.generate(prompts, sp)
        del llm
        gc.collect()
    want = outs["device"]
    r = {}
    for placement in ("host", "mmap"):
        got = outs[placement]
        same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
        diff = max(abs(la[t] - lb[t]) for a, b in zip(got, want) for t, la, lb in zip(a.token_ids, a.logprobs, b.logprobs))
        r[placement] = {"identical_streams": same, "of": len(prompts), "max_logprob_diff": diff}
        print(f"  Engram tables {placement} vs device: {same}/{len(prompts)} identical greedy streams, "
              f"logprob diff {diff:.1e}", flush=True)
    return r


def kv_bytes(kv_gb: int, reserve_gb: int = 4) -> int:
    """The KV pool: kv_gb GiB, or what the GPU has left after the share's weights and reserve_gb GiB for
    activations where that is less (world 4 on an 80 GB card); refused below 2 GiB."""
    free = torch.cuda.mem_get_info()[0] - (reserve_gb << 30)
    if free < 2 << 30:
        raise SystemExit(f"the share's weights leave {free / 2**30:.1f} GiB for the KV pool after {reserve_gb} GiB of "
                         "activations: a larger GPU, or a smaller --experts / --engram-vocab")
    return min(kv_gb << 30, free)


def one_world(world: int, a, device: str) -> dict:
    tmp = write_config(Path(tempfile.mkdtemp(prefix="v41-share-")), a.preset, a.experts, a.engram_vocab,
                       device == "cuda")
    cfg = load_config(tmp)
    check_parallel(cfg, world, True)
    tp = TensorParallel(0, world, expert_parallel=True, share_only=True)
    t0 = time.perf_counter()
    model = random_share(tmp, tp, device)
    built_s = time.perf_counter() - t0
    original = registry.load_model
    batches = [int(b) for b in a.batches.split(",")]
    lengths = [int(n) for n in a.ttft.split(",") if n]
    chunk = max(lengths + [2048])
    engine_args = {"model": str(tmp), "max_model_len": max(chunk, a.input_len + a.steps + 64) + 64,
                   "max_num_seqs": max(batches) + 8, "max_num_batched_tokens": chunk, "block_size": 128,
                   "engram_tables": "host"}
    if device == "cuda":
        engine_args["kv_cache_memory_bytes"] = kv_bytes(a.kv_gb)
    registry.load_model = lambda *args, **kw: model  # the engine runs the share built above
    try:
        eng = LLM(**engine_args).engine
    finally:
        registry.load_model = original
    out = {"world": world, "heads": tp.local_heads(cfg), "experts": tp.local_experts(cfg),
           "engram_rows": sum(hi - lo for lo, hi in model.host_tables.spans.values()),
           "engram_host_GB": model.host_tables.nbytes / 1e9, "build_s": built_s,
           "weights_GB": sum(t.numel() * t.element_size() for t in model.parameters()) / 1e9}
    from tools.bench_engine import copy_bandwidth

    bw = copy_bandwidth() if device == "cuda" else 1e11
    out["copy_TB_s"] = bw / 1e12
    out["decode"] = []
    for b in batches:
        got = {}
        g = engram_window(model, lambda b=b: got.setdefault("ms", steady_step_ms(eng, b, a.input_len, a.steps)))
        floor = floor_bytes(model, b)
        row = {"batch": b, "step_ms": got["ms"], "floor_ms": floor / bw * 1e3, "read_GB": floor / 1e9, **g}
        out["decode"].append(row)
        print(f"  world {world}: decode batch {b}: {row['step_ms']:.2f} ms/step (floor {row['floor_ms']:.2f} ms), "
              f"Engram gather {g['gather_ms']:.3f} ms, exposed {g['exposed_ms']:.3f} ms", flush=True)
    out["ttft"] = []
    for n in lengths:
        got = {}
        g = engram_window(model, lambda n=n: got.setdefault("ms", ttft_ms(eng, n)))
        out["ttft"].append({"prompt": n, "ttft_ms": got["ms"], **g})
        print(f"  world {world}: TTFT {n}: {got['ms']:.1f} ms, Engram gather {g['gather_ms']:.2f} ms, "
              f"exposed {g['exposed_ms']:.2f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8", help="tensor_parallel_size values whose rank 0 share is timed")
    ap.add_argument("--preset", default="v41-flash-shaped", help="v41-tiny: the CPU smoke test's")
    ap.add_argument("--experts", type=int, default=RELEASED["n_routed_experts"])
    ap.add_argument("--engram-vocab", type=int, default=RELEASED["engram_vocab_size"],
                    help="engram_vocab_size (rows a table = 24 x this, about): 16M as released")
    ap.add_argument("--batches", default="1,32,150")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ttft", default="1024,8192", help="TTFT prompt lengths ('' for none)")
    ap.add_argument("--kv-gb", type=int, default=12, help="KV pool bytes (GiB) on the GPU, at most what the weights leave")
    ap.add_argument("--check", action="store_true", help="first: host and mmap tables against device tables "
                    "on a tiny V4.1 in the released formats (greedy streams and logprobs)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    check = check_host_tables(device) if a.check else None
    results = []
    for w in a.worlds.split(","):
        results.append(one_world(int(w), a, device))
        gc.collect()  # the share and its host tables go before the next one is drawn
        if device == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nrank 0's share of DeepSeek-V4.1-Flash ({a.experts} experts, engram_vocab_size {a.engram_vocab}) on {gpu}, "
          f"Engram tables in host RAM; {time.perf_counter() - t0:.0f} s in all")
    print(f"{'N':>3} {'what':>10} {'ms':>9} {'floor ms':>9} {'gather ms':>10} {'exposed ms':>11} {'hidden':>7}")
    for r in results:
        for d in r["decode"]:
            print(f"{r['world']:>3} {'b=' + str(d['batch']):>10} {d['step_ms']:>9.2f} {d['floor_ms']:>9.2f} "
                  f"{d['gather_ms']:>10.3f} {d['exposed_ms']:>11.3f} {_hidden(d):>7}")
        for t in r["ttft"]:
            print(f"{r['world']:>3} {'TTFT ' + str(t['prompt']):>10} {t['ttft_ms']:>9.1f} {'':>9} "
                  f"{t['gather_ms']:>10.2f} {t['exposed_ms']:>11.2f} {_hidden(t):>7}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device, "gpu": gpu, "experts": a.experts,
                                            "engram_vocab_size": a.engram_vocab, "check": check,
                                            "worlds": results}, indent=2))
    bad = {k: c for k, c in (check or {}).items() if c["identical_streams"] != c["of"]}
    if bad:
        raise SystemExit(f"Engram tables in host memory differ from device tables: {bad}")


def _hidden(r: dict) -> str:
    return f"{1 - r['exposed_ms'] / r['gather_ms']:.0%}" if r["gather_ms"] > 0 else "-"


if __name__ == "__main__":
    main()
