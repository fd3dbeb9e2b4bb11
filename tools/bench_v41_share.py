"""One tensor-parallel rank's share of DeepSeek-V4.1-Flash at its released size, timed on one GPU (a
script, not a test): decode steps at batch 1 / 32 / 150 against the rank's floor, TTFT at 1K / 8K,
and the Engram gather from host memory: its time, and what host tables cost the step against
device tables.

    python -m tools.bench_v41_share [--worlds 4,8] [--experts 384] [--engram-vocab 16000000] \
        [--compare-vocab 1000000] [--batches 1,32,150] [--ttft 1024,8192] [--check] [--json out.json]

The share is rank 0's at tensor_parallel_size N with expert parallelism (engine/models/deepseek_v41/shards.py):
num_heads / N heads and their output groups, 384 / N routed experts of the released width (2304) in
MXFP4, the shared expert's 1/N slice, FP8 32x32 linears as stored, the replicated compressors and
indexers, the LM head; and rank 0's rows of the two Engram tables at the released row count
(engram_vocab_size 16M: 384M rows a table; a rank holds 1/N of them, FP8 rows + a scale per 32
channels, ~25 GB at N = 8, ~50 GB at N = 4) in host RAM, registered for the GPU and gathered by it
inside the step (`engram_tables: host`, engine/models/deepseek_v41/mapped_tables.py; the time to
register them is reported). --engram-vocab scales the tables down when the host's RAM is smaller.
Weights are drawn in place on the GPU in their stored formats (no checkpoint on disk) and run by the
real engine (scheduler, runner, decode CUDA graphs, async scheduling) with the collectives skipped
(TensorParallel.share_only): the compute a rank does between its all-reduces. Mixed prefill + decode
steps run eagerly here (cudagraph_mode FULL_DECODE_ONLY): TTFT is an eager prefill.

Floor: the bytes a decode step must read on this rank (weights as stored, the routed experts the
batch is expected to hit) over the measured copy bandwidth (tools/bench_engine.copy_bandwidth).

Engram: the gather runs inside the step on a side stream (hash the step's ids, read its rows over
PCIe, dequantize), overlapped with the layers before each Engram layer; with CUDA graphs it is a
branch of the graph, so there is no host-side wait to time. `gather ms` is that side-stream work
alone for the step's tokens (CUDA events, nothing else running; GB/s: the rows' stored bytes over
it). What it costs the step is measured as a difference: at --compare-vocab (a row count a GPU
holds), the same share decodes with the same tables once in host RAM and once in GPU memory (same
kernel, same graphs); `host - device ms` is the step time host tables add (0 when the overlap hides
the gather, within noise). The two copies' gathered rows must be equal, bit for bit.
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
from engine.models.deepseek_v41.config import V41Config, load_config
from engine.models.deepseek_v41.engram_tables import StoredTable
from engine.models.deepseek_v41.mapped_tables import MappedTables
from engine.models.deepseek_v41.model import DeepseekV41, engram_hasher, hold_fp32_weights
from engine.models.deepseek_v41.random_checkpoint import FP8_TILE, build_text_config, write_v41_checkpoint
from engine.models.deepseek_v41.shards import table_span
from engine.models.stacked_linears import stack_linears
from engine.parallel import TensorParallel, check_parallel
from engine.request import GenerationRequest, SamplingParams
from tools.bench_engine import random_prompts, steady_step_ms
from tools.bench_tp_share import fill_random

RELEASED = {"n_routed_experts": 384, "engram_vocab_size": 16_000_000}
PATTERN_ROWS = 65_521  # distinct random rows, tiled over a released-size table (a fill at copy speed)


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
    """Rank 0's modules with random weights in their stored formats; no Engram tables (set_tables)."""
    cfg = load_config(model_dir)
    cuda = device == "cuda"
    with torch.device("meta"):
        model = DeepseekV41(cfg, quantized=cuda, fp8_linears=cuda, tp=tp, engram_on_device=False)
    model.to_empty(device=device)
    model.cast(torch.bfloat16)
    fill_random(model, cfg, device)
    model.main_inv_freq = cfg.main_rope.inv_freq().to(device)
    model.compress_inv_freq = cfg.compress_rope.inv_freq().to(device)
    if cuda:
        stack_linears(model)
    hold_fp32_weights(model)
    return model.eval()


def stored_tables(cfg: V41Config, tp: TensorParallel, seed: int = 0) -> dict[int, StoredTable]:
    """This rank's rows of each table in host RAM in the released format: PATTERN_ROWS distinct random rows
    of finite e4m3 values tiled over the table (a fill at copy speed), ue8m0 scales of 2^-7."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in cfg.engram_layer_ids:
        lo, hi = table_span(cfg, layer, tp)
        n, d = hi - lo, cfg.engram_head_dim
        period = min(n, PATTERN_ROWS)
        pattern = torch.randint(0x20, 0x79, (period, d), generator=g, dtype=torch.uint8)  # e4m3 up to 256: no NaN
        rows = torch.empty(n, d, dtype=torch.uint8)
        whole = n // period * period
        rows[:whole].view(-1, period, d).copy_(pattern.expand(n // period, period, d))
        rows[whole:].copy_(pattern[:n - whole])
        scale = torch.full((n, d // 32), 120, dtype=torch.uint8)
        out[layer] = StoredTable(rows.view(torch.float8_e4m3fn), scale)
    return out


def set_tables(model: DeepseekV41, model_dir: Path, tables: dict[int, StoredTable]) -> MappedTables:
    """The share's Engram tables and the hasher for their layout (model_dir's engram_vocab_size)."""
    cfg = load_config(model_dir)
    device = next(model.parameters()).device
    model.host_tables = None  # the previous tables are unregistered before these are registered
    gc.collect()
    model.engram_hasher = engram_hasher(cfg).to(device)
    model.engram_hasher.bind_tokenizer(model_dir / "tokenizer.json", cfg.vocab_size)
    spans = {layer: table_span(cfg, layer, model.tp) for layer in cfg.engram_layer_ids}
    model.host_tables = MappedTables(tables, spans, torch.bfloat16, device, copy=False)
    return model.host_tables


def floor_bytes(model: DeepseekV41, batch: int) -> float:
    """Bytes a decode step of `batch` rows reads on this rank: every weight as stored (scales too)
    but the routed experts no row is expected to pick, the embedding (a lookup) and the Engram tables."""
    cfg = model.cfg
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b is not None and n.endswith("scale"))]
    experts = sum(t.numel() * t.element_size() for n, t in named if ".experts_w" in n)
    other = sum(t.numel() * t.element_size() for n, t in named if ".experts_w" not in n and not n.startswith("embed"))
    return other + experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)


def engram_inputs(model: DeepseekV41, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input ids and look-back of `tokens` rows on the model's device."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(5, model.cfg.vocab_size, (tokens, 1 + model.lookback_tokens), generator=g).to(device)
    return ids[:, 0].contiguous(), ids[:, 1:].contiguous()


def gathered(model: DeepseekV41, input_ids: torch.Tensor, lookback: torch.Tensor) -> dict[int, torch.Tensor]:
    """One step's Engram work as the forward starts it: ids hashed, every layer's rows gathered (joined)."""
    cfg = model.cfg
    wanted = list(enumerate(cfg.engram_layer_ids))
    fetch = model.host_tables.start(lambda: model.engram_hasher(input_ids, lookback), wanted,
                                    (input_ids.shape[0], model.engram_hasher.offsets.shape[-1]))
    return {layer: fetch(layer) for _, layer in wanted}


def gather_timing(model: DeepseekV41, tokens: int, reps: int = 10) -> dict:
    """ms of a step's Engram work for `tokens` rows alone (CUDA events on the compute stream around the
    side stream's fork and join), and the GB/s of the rows' stored bytes read."""
    input_ids, lookback = engram_inputs(model, tokens)
    cuda = input_ids.is_cuda
    gathered(model, input_ids, lookback)  # compiles the kernel for this shape class
    if cuda:
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
    start = time.perf_counter()
    for _ in range(reps):
        gathered(model, input_ids, lookback)
    if cuda:
        t1.record()
        t1.synchronize()
        ms = t0.elapsed_time(t1) / reps
    else:
        ms = (time.perf_counter() - start) * 1e3 / reps
    tables = model.host_tables.tables.values()
    stored = sum(t.rows.shape[-1] * t.rows.element_size() + (0 if t.scale is None else t.scale.shape[-1])
                 for t in tables)  # one row of every table, as stored
    nbytes = tokens * model.engram_hasher.offsets.shape[-1] * stored
    return {"gather_ms": ms, "gather_GB_s": nbytes / ms / 1e6}


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


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    """The tokens two greedy streams share before they part (their logprobs compare there only)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def check_host_tables(device: str, settings: dict | None = None) -> dict:
    """Greedy streams and logprobs of a tiny V4.1 in the released formats (FP8 Engram rows) with its
    tables in host RAM (the device gathers them inside decode and mixed-step graphs, async scheduling
    on) and memory-mapped (host threads: decode graphs fed before each replay, async scheduling off),
    each against the same engine settings with the tables on the device."""
    path = write_v41_checkpoint(Path(tempfile.mkdtemp(prefix="v41-check-")), "v41-tiny", seed=0, device=device,
                                quant="fp8-fp4")
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    prompts = random_prompts(3, 300, 4000, seed=5)
    prompts = [p[:60 + 100 * i] for i, p in enumerate(prompts)]
    settings = settings or {"host": {"cudagraph_mode": "FULL", "async_scheduling": True},
                            "mmap": {"cudagraph_mode": "FULL_DECODE_ONLY", "async_scheduling": False}}

    def run(placement: str, mode: dict):
        # a small KV pool: the default sizes it from free memory, which an earlier engine's graphs still hold
        llm = LLM(model=str(path), engram_tables=placement, max_model_len=512, max_num_seqs=8, block_size=16,
                  max_num_batched_tokens=128, **mode,
                  **({"kv_cache_memory_bytes": 1 << 30} if device == "cuda" else {"dtype": "float32"}))
        try:
            return llm.generate(prompts, sp)
        finally:
            del llm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()

    r = {}
    for placement, mode in settings.items():
        want, got = run("device", mode), run(placement, mode)
        same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
        diff = max(abs(la[t] - lb[t]) for a, b in zip(got, want)
                   for t, la, lb in zip(common_prefix(a.token_ids, b.token_ids), a.logprobs, b.logprobs))
        r[placement] = {"identical_streams": same, "of": len(prompts), "max_logprob_diff": diff, **mode}
        print(f"  Engram tables {placement} vs device ({mode}): {same}/{len(prompts)} identical greedy streams, "
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


def share_engine(model: DeepseekV41, engine_args: dict, device: str):
    """The real engine over the share built here (the registry's loader is bypassed)."""
    args = dict(engine_args)
    if device == "cuda":
        args["kv_cache_memory_bytes"] = kv_bytes(args.pop("kv_gb"))
    else:
        args.pop("kv_gb")
    original = registry.load_model
    registry.load_model = lambda *a, **kw: model
    try:
        return LLM(**args).engine
    finally:
        registry.load_model = original


def release() -> None:
    """What a dropped engine held (graphs, KV pool) freed before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare_tables(model: DeepseekV41, a, engine_args: dict, device: str, batches: list[int]) -> dict:
    """Decode step ms with the same tables at a.compare_vocab in host RAM and on the GPU, and whether the
    two gather the same rows."""
    cmp_dir = write_config(Path(tempfile.mkdtemp(prefix="v41-cmp-")), a.preset, a.experts, a.compare_vocab,
                           device == "cuda")
    tables = stored_tables(load_config(cmp_dir), model.tp, seed=1)
    out = {"engram_vocab": a.compare_vocab, "decode": [{"batch": b} for b in batches]}
    rows = {}
    for where in ("device", "host"):
        placed = tables if where == "host" or device != "cuda" else {
            k: StoredTable(t.rows.to(device), t.scale.to(device)) for k, t in tables.items()}
        set_tables(model, cmp_dir, placed)
        rows[where] = {k: v.cpu() for k, v in gathered(model, *engram_inputs(model, max(batches))).items()}
        eng = share_engine(model, engine_args, device)
        for r in out["decode"]:
            r[f"{where}_ms"] = steady_step_ms(eng, r["batch"], a.input_len, a.steps)
        del eng
        release()
    out["identical_rows"] = all(torch.equal(rows["host"][k], rows["device"][k]) for k in rows["host"])
    for r in out["decode"]:
        print(f"  world {model.tp.world}: decode batch {r['batch']} at engram_vocab_size {a.compare_vocab}: "
              f"host tables {r['host_ms']:.2f} ms/step, device tables {r['device_ms']:.2f} ms/step", flush=True)
    print(f"  world {model.tp.world}: host and device tables gather identical rows: {out['identical_rows']}", flush=True)
    return out


def one_world(world: int, a, device: str) -> dict:
    tmp = write_config(Path(tempfile.mkdtemp(prefix="v41-share-")), a.preset, a.experts, a.engram_vocab,
                       device == "cuda")
    cfg = load_config(tmp)
    check_parallel(cfg, world, True)
    tp = TensorParallel(0, world, expert_parallel=True, share_only=True)
    t0 = time.perf_counter()
    model = random_share(tmp, tp, device)
    built_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tables = set_tables(model, tmp, stored_tables(cfg, tp))
    fill_s = time.perf_counter() - t0 - tables.pin_s
    batches = [int(b) for b in a.batches.split(",")]
    lengths = [int(n) for n in a.ttft.split(",") if n]
    chunk = max(lengths + [2048])
    seqs = max(batches)  # the runner captures a decode graph at max_num_seqs
    engine_args = {"model": str(tmp), "max_model_len": max(chunk, a.input_len + a.steps + 64) + 64,
                   "max_num_seqs": seqs, "max_num_batched_tokens": chunk, "block_size": 128,
                   "cudagraph_mode": "FULL_DECODE_ONLY", "engram_tables": "host", "kv_gb": a.kv_gb}
    eng = share_engine(model, engine_args, device)
    out = {"world": world, "heads": tp.local_heads(cfg), "experts": tp.local_experts(cfg),
           "engram_rows": sum(hi - lo for lo, hi in tables.spans.values()), "engram_host_GB": tables.nbytes / 1e9,
           "build_s": built_s, "engram_fill_s": fill_s, "engram_pin_s": tables.pin_s,
           "async_scheduling": eng.async_scheduling,
           "weights_GB": sum(t.numel() * t.element_size() for t in model.parameters()) / 1e9}
    print(f"  world {world}: {out['engram_host_GB']:.1f} GB of Engram rows in host RAM, registered for the GPU in "
          f"{tables.pin_s:.1f} s", flush=True)
    from tools.bench_engine import copy_bandwidth

    bw = copy_bandwidth() if device == "cuda" else 1e11
    out["copy_TB_s"] = bw / 1e12
    out["decode"] = []
    for b in batches:
        step = steady_step_ms(eng, b, a.input_len, a.steps)
        floor = floor_bytes(model, b)
        row = {"batch": b, "step_ms": step, "floor_ms": floor / bw * 1e3, "read_GB": floor / 1e9,
               **gather_timing(model, b)}
        out["decode"].append(row)
        print(f"  world {world}: decode batch {b}: {step:.2f} ms/step (floor {row['floor_ms']:.2f} ms), Engram "
              f"gather {row['gather_ms']:.3f} ms on its side stream ({row['gather_GB_s']:.1f} GB/s)", flush=True)
    out["ttft"] = []
    for n in lengths:
        row = {"prompt": n, "ttft_ms": ttft_ms(eng, n), **gather_timing(model, n, reps=3)}
        out["ttft"].append(row)
        print(f"  world {world}: TTFT {n}: {row['ttft_ms']:.1f} ms, Engram gather {row['gather_ms']:.2f} ms "
              f"({row['gather_GB_s']:.1f} GB/s)", flush=True)
    del eng, tables
    release()
    if a.compare_vocab:
        out["compare"] = compare_tables(model, a, engine_args, device, batches)
    model.host_tables = None  # unregistered and freed before the next world's are drawn
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8", help="tensor_parallel_size values whose rank 0 share is timed")
    ap.add_argument("--preset", default="v41-flash-shaped", help="v41-tiny: the CPU smoke test's")
    ap.add_argument("--experts", type=int, default=RELEASED["n_routed_experts"])
    ap.add_argument("--engram-vocab", type=int, default=RELEASED["engram_vocab_size"],
                    help="engram_vocab_size (rows a table = 24 x this, about): 16M as released")
    ap.add_argument("--compare-vocab", type=int, default=None,
                    help="engram_vocab_size at which host and device tables are compared (0: not; default "
                         "1000000 on a GPU, 0 on the CPU, where both are RAM)")
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
    if a.compare_vocab is None:
        a.compare_vocab = 1_000_000 if device == "cuda" else 0
    t0 = time.perf_counter()
    check = check_host_tables(device) if a.check else None
    results = []
    for w in a.worlds.split(","):
        results.append(one_world(int(w), a, device))
        gc.collect()  # the share goes before the next one is drawn
        if device == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nrank 0's share of DeepSeek-V4.1-Flash ({a.experts} experts, engram_vocab_size {a.engram_vocab}) on {gpu}, "
          f"Engram tables in host RAM gathered by the GPU inside the step; {time.perf_counter() - t0:.0f} s in all")
    print(f"{'N':>3} {'what':>10} {'ms':>9} {'floor ms':>9} {'gather ms':>10} {'GB/s':>7} "
          f"{'host ms':>9} {'device ms':>10}   (host / device: decode at engram_vocab_size {a.compare_vocab})")
    for r in results:
        cmp = {c["batch"]: c for c in r.get("compare", {}).get("decode", [])}
        for d in r["decode"]:
            c = cmp.get(d["batch"], {})
            print(f"{r['world']:>3} {'b=' + str(d['batch']):>10} {d['step_ms']:>9.2f} {d['floor_ms']:>9.2f} "
                  f"{d['gather_ms']:>10.3f} {d['gather_GB_s']:>7.1f} {c.get('host_ms', float('nan')):>9.2f} "
                  f"{c.get('device_ms', float('nan')):>10.2f}")
        for t in r["ttft"]:
            print(f"{r['world']:>3} {'TTFT ' + str(t['prompt']):>10} {t['ttft_ms']:>9.1f} {'':>9} "
                  f"{t['gather_ms']:>10.2f} {t['gather_GB_s']:>7.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device, "gpu": gpu, "experts": a.experts,
                                            "engram_vocab_size": a.engram_vocab, "check": check,
                                            "worlds": results}, indent=2))
    bad = {k: c for k, c in (check or {}).items() if c["identical_streams"] != c["of"]}
    if bad:
        raise SystemExit(f"Engram tables in host memory differ from device tables: {bad}")
    if any(not r["compare"]["identical_rows"] for r in results if "compare" in r):
        raise SystemExit("Engram rows gathered from host RAM differ from the same rows on the GPU")


if __name__ == "__main__":
    main()
