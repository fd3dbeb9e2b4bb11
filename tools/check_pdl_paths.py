"""Programmatic dependent launch (kernels/pdl.py) changes when a kernel may start, never what it computes:
every served path must give the same logits, tokens and drafts with PDL on as with it off, bit for bit.

Per checkpoint two engines are built alike but for the `pdl` engine argument (off, then on: each captures
its graphs under its own setting, and each step runs under its engine's), and the same script of greedy
requests runs through both. Hooks on the runner and the speculative graphs (instance attributes over their
methods, nothing in the engine changed) record what each path returns, labelled by path:

- no drafter: a prefill in eager steps (mixed graphs set aside: how FULL_DECODE_ONLY serves it), its later
  chunks, pure prefill chunks and mixed steps (prefill chunks + decodes) through the mixed-step graphs,
  decode graphs at each batch bucket of --batches;
- MTP (the preview layout): verify graphs' logits, the rollback graphs' effect (the compressors' rolling
  state after each), the MTP draft graphs' drafts;
- DSpark (0731 layout, --dspark-model): verify graphs' logits and target features, the plain-step graphs'
  (a step that verifies nothing), the drafter graphs' drafts after each, rollback as above;
- every request's sampled tokens.

The table: path -> records -> max |difference| (token and draft records: how many differ) -> identical?
Exit 1 if any path differs, or an expected path never ran (the check would say nothing about it). On the
CPU there is no PDL (the switch never reaches a launch) and no graph: the static batches the graphs would
replay run eagerly, so the same paths run and compare trivially (tests/tools/test_check_pdl_paths.py).

    python -m tools.check_pdl_paths --model CKPT [--dspark-model CKPT] [--batches 1,8,32] [--json OUT]
                                                                                         (suite pdl_paths)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams
from engine.runner import decode_buckets
from engine.spec.decoder import dspark_graphs
from engine.spec.draft_graphs import DraftGraphs
from engine.spec.verify_graphs import VerifyGraphs
from kernels import pdl
from tools.bench_engine import random_prompts

KV_BYTES_CUDA = 2 << 30  # per engine: two engines share the GPU
MTP_K = 3


@dataclass
class Records:
    """path -> what it returned, step after step (tensors on the host, or plain values)."""

    by_path: dict[str, list] = field(default_factory=dict)

    def add(self, path: str, value) -> None:
        if isinstance(value, torch.Tensor):
            if not value.numel():  # a prefill chunk short of its prompt's end: no logits (its KV shows later)
                return
            value = value.detach().float().cpu().clone()
        self.by_path.setdefault(path, []).append(value)


def engine_args(model: str, budget: int, max_num_seqs: int, spec: dict | None) -> dict:
    args = {"model": model, "max_model_len": 1024, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "enable_prefix_caching": False, "seed": 0,
            "async_scheduling": True}  # as served on the GPU; on the CPU too, so the in-flight plain steps run
    if spec is not None:  # speculative steps with prefill run eagerly anyway: no mixed-step graphs to capture
        args |= {"speculative_config": spec, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if torch.cuda.is_available():
        args["kv_cache_memory_bytes"] = KV_BYTES_CUDA
    return args


def static_paths(eng: LLMEngine) -> None:
    """On the CPU (no graphs): the padded static batches every graph set would replay, run eagerly, so the
    same paths run (as the graph tests do: tests/engine/spec/test_verify_graphs.py, test_dspark_graphs.py)."""
    runner, a = eng.runner, eng.args
    buckets = decode_buckets(a.max_num_seqs)
    runner.static_decode_batches(buckets)
    if eng.spec is None:
        runner.mixed = MixedStepGraphs(eng.model, eng.cache, eng.max_model_len, a.max_num_seqs,
                                       mixed_sizes(a.max_num_batched_tokens))
        return
    spec = eng.spec
    verify_buckets = [b for b in buckets if b * (spec.k + 1) <= a.max_num_batched_tokens]
    if spec.dspark is not None:
        spec.use_dspark_graphs(dspark_graphs(eng, spec.k, spec.dspark, verify_buckets))
    else:
        spec.verify_steps = VerifyGraphs(eng.model, eng.cache, eng.max_model_len, spec.k, verify_buckets)
        spec.draft_steps = DraftGraphs(spec.mtp, eng.model, spec.mtp_cache, spec.verify_steps)


def build(args: dict, on: bool) -> LLMEngine:
    eng = LLMEngine({**args, "pdl": "on" if on else "off"}, detokenize=False)
    if eng.device.type == "cpu":
        static_paths(eng)
    return eng


@contextmanager
def launching(eng: LLMEngine):
    """The PDL switch is process-wide and read at each eager launch: each engine runs under its own."""
    pdl.set_enabled(eng.args.pdl == "on")
    try:
        yield
    finally:
        pdl.set_enabled(False)


def _wrap(obj, name: str, after: Callable) -> None:
    """obj.name(...) then after(result, *args): an instance attribute over the method."""
    method = getattr(obj, name)

    def wrapped(*args, **kwargs):
        out = method(*args, **kwargs)
        after(out, *args, **kwargs)
        return out
    setattr(obj, name, wrapped)


def runner_path(runner, scheduled, all_logits: bool = False, prompt_rows=None) -> str:
    """Which path runner.run takes for this step, in the table's words."""
    decode = [s.num_computed_tokens == s.num_tokens - 1 and n == 1 for s, n in scheduled]
    if prompt_rows is None and runner._decode_graph(scheduled, all_logits):
        return f"decode graph b{min(b for b in runner.graphs if b >= len(scheduled))}"
    first = any(s.num_computed_tokens == 0 for s, _ in scheduled)
    kind = "mixed (prefill + decodes)" if any(decode) else "prefill" if first else "prefill, later chunks"
    graphed = prompt_rows is None and runner.mixed is not None and runner.mixed.fits(scheduled, all_logits)
    return f"{kind}, {'mixed-step graph' if graphed else 'eager'}"


def instrument(eng: LLMEngine, rec: Records) -> None:
    runner = eng.runner
    run = runner.run

    def recorded(scheduled, all_logits=False, **kwargs):
        path = runner_path(runner, scheduled, all_logits, kwargs.get("prompt_rows"))
        out = run(scheduled, all_logits, **kwargs)
        rec.add(path, out)
        return out
    runner.run = recorded
    spec = eng.spec
    if spec is None:
        return
    name = "DSpark" if spec.dspark is not None else "MTP"
    if spec.verify_steps is not None:
        def verified(out, batch):
            b = spec.verify_steps.bucket(len(batch))
            rec.add(f"{name} verify graph b{b}: logits", out.logits)
            if out.features is not None:
                rec.add(f"{name} verify graph b{b}: target features", out.features)
        _wrap(spec.verify_steps, "run", verified)
        states = lambda: [t for st in spec._states() for t in vars(st).values() if isinstance(t, torch.Tensor)]
        _wrap(spec.verify_steps.rollback, "run",
              lambda _, n, fixes: rec.add(f"{name} rollback graph: compressor states", torch.cat(
                  [t.float().flatten() for t in states()])))
    if spec.plain_steps is not None:
        def plain(out, batch, pending=None):
            b = spec.plain_steps.bucket(len(batch))
            rec.add(f"DSpark plain-step graph b{b}: logits", out[0])
            rec.add(f"DSpark plain-step graph b{b}: target features", out[1])
        _wrap(spec.plain_steps, "run", plain)


def step(eng: LLMEngine, rec: Records) -> None:
    """One engine step; with a drafter, the drafts it set, labelled by the path that drafted them."""
    spec = eng.spec
    before = dict(spec.step_paths) if spec is not None else {}
    eng.step()
    if spec is None:
        return
    ran = {k for k, v in spec.step_paths.items() if v > before[k]}
    if "draft_graph" in ran:
        name = ("DSpark drafter graph after a plain step" if "plain_graph" in ran else
                "DSpark drafter graph after a verify graph" if spec.dspark is not None else "MTP draft graph")
    elif "draft_eager" in ran:
        name = f"{'DSpark' if spec.dspark is not None else 'MTP'} drafts, eager"
    else:
        return
    rec.add(f"{name}: drafts", sorted(spec.mtp_drafts.items()))


@contextmanager
def mixed_aside(runner):
    """Mixed-step graphs set aside (decode graphs kept): prefill and mixed steps run eagerly, as
    cudagraph_mode FULL_DECODE_ONLY serves them."""
    mixed, runner.mixed = runner.mixed, None
    try:
        yield
    finally:
        runner.mixed = mixed


def script(eng: LLMEngine, rec: Records, batches: list[int], decode_steps: int = 3) -> dict[str, list[int]]:
    """The same greedy requests, added at the same steps: prompts() through the mixed-step graphs (then
    dropped), again in eager steps (no drafter), one more in mixed steps, then more requests until
    each batch of `batches` decodes for decode_steps steps. -> each request's sampled tokens."""
    budget, vocab = eng.args.max_num_batched_tokens, eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=eng.max_model_len // 2, temperature=0, ignore_eos=True)
    seqs, added = {}, iter(range(1 << 20))

    def add(n: int, length: int, params: SamplingParams = sp) -> None:
        for p in random_prompts(n, length, vocab, seed=len(seqs)):
            rid = f"pdl-{next(added)}"
            seqs[rid] = eng.add_request(GenerationRequest(rid, prompt_token_ids=p, sampling=params))

    def prompts() -> None:
        """A prompt of half a step, done after its prefill (so the first step's logits), and one of two steps
        beside it (then its later chunks alone)."""
        add(1, budget // 2, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        add(1, 2 * budget)

    def prefill_then(steps: int) -> None:
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            step(eng, rec)
        for _ in range(steps):
            step(eng, rec)
        eng.flush()

    spec = eng.spec is not None
    decode = decode_steps * (3 if spec else 1)  # speculative: enough steps to verify, roll back and back off
    if not spec:  # prefill chunks through the mixed-step graphs, nothing decoding beside them
        prompts()
        prefill_then(0)
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.flush()
    with mixed_aside(eng.runner):  # eager: first chunks, then later ones
        if spec:
            add(1, budget // 2)
        else:
            prompts()
        prefill_then(decode)
    if not spec:  # a prefill beside a decode
        add(1, budget // 2 + 7)
        prefill_then(decode_steps)
    for b in batches:
        running = len(eng.scheduler.running)
        if b > running:
            add(b - running, 24)
            prefill_then(decode)
    out = {rid: list(s.output_token_ids) for rid, s in seqs.items()}
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.flush()
    return out


def difference(a, b) -> float:
    """Tensors: max |a - b| (inf where shapes differ); anything else: 0 if equal, else how many items differ."""
    if isinstance(a, torch.Tensor):
        return float((a - b).abs().max()) if a.shape == b.shape and a.numel() else 0.0 if a.shape == b.shape \
            else float("inf")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return float(sum(x != y for x, y in zip(a, b)))
    return float(a != b)


def compare(off: Records, on: Records) -> list[dict]:
    rows = []
    for path in sorted(set(off.by_path) | set(on.by_path)):
        a, b = off.by_path.get(path, []), on.by_path.get(path, [])
        d = max((difference(x, y) for x, y in zip(a, b)), default=0.0)
        if len(a) != len(b):
            d = float("inf")
        rows.append({"path": path, "records": [len(a), len(b)], "max_diff": d, "identical": d == 0})
    return rows


def expected(eng: LLMEngine, batches: list[int]) -> list[str]:
    """Path names the script must have run (prefixes of recorded paths)."""
    spec = eng.spec
    if spec is None:
        return ["prefill, eager", "prefill, later chunks, eager", "prefill, mixed-step graph",
                "prefill, later chunks, mixed-step graph", "mixed (prefill + decodes), mixed-step graph",
                *(f"decode graph b{min(g for g in eng.runner.graphs if g >= b)}" for b in batches)]
    if spec.dspark is None:
        return ["MTP verify graph", "MTP rollback graph", "MTP draft graph", "sampled tokens"]
    return ["DSpark verify graph", "DSpark rollback graph", "DSpark plain-step graph",
            "DSpark drafter graph after a verify graph", "DSpark drafter graph after a plain step", "sampled tokens"]


def check_pair(args: dict, batches: list[int], label: str) -> tuple[list[dict], list[str], bool]:
    """Both engines of one configuration, one after the other (one on the device at a time).
    -> (table rows, expected paths that never ran, whether PDL really launched)."""
    runs, effective, names = [], False, []
    for on in (False, True):
        eng = build(args, on)
        rec = Records()
        instrument(eng, rec)
        with launching(eng):
            tokens = script(eng, rec, batches)
        rec.add("sampled tokens", [tokens[k] for k in sorted(tokens)])
        runs.append(rec)
        effective |= eng.pdl
        names = expected(eng, batches)
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = [{"engine": label, **r} for r in compare(*runs)]
    missing = [n for n in names if not any(r["path"].startswith(n) and min(r["records"]) for r in rows)]
    return rows, missing, effective


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a preview-layout checkpoint ('': the tiny one): prefill, mixed and "
                    "decode graphs, then MTP's")
    ap.add_argument("--dspark-model", default=None, help="a 0731-layout checkpoint: DSpark's graphs")
    ap.add_argument("--batches", default="1,8,32", help="decode batches, each through its graph bucket")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (prompts are sized from it)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if os.environ.pop(pdl.ENV, None) is not None:
        print(f"{pdl.ENV} ignored: the check sets PDL per engine", flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    seqs = max(batches)
    pairs = [("plain", engine_args(a.model, a.budget, seqs, None)),
             ("mtp", engine_args(a.model, a.budget, seqs, {"method": "mtp", "num_speculative_tokens": MTP_K}))]
    if a.dspark_model is not None:
        pairs.append(("dspark", engine_args(a.dspark_model, a.budget, seqs, {"method": "dspark"})))
    rows, missing, effective = [], [], True
    for label, args in pairs:
        print(f"{label}: PDL off, then on", flush=True)
        r, m, eff = check_pair(args, batches, label)
        rows += r
        missing += [f"{label}: {n}" for n in m]
        effective &= eff
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"PDL on vs off on {device} (PDL {'launched' if effective else 'NOT launched: this device has none'}):")
    print(f"{'engine':>7} | {'path':<60} | {'records':>9} | {'max |diff|':>10} | identical?")
    for r in rows:
        print(f"{r['engine']:>7} | {r['path']:<60} | {r['records'][0]:>4}/{r['records'][1]:<4} | {r['max_diff']:10.3g} | "
              f"{'yes' if r['identical'] else 'NO'}")
    for m in missing:
        print(f"NOT RUN: {m}")
    if a.json:
        meta = {"argv": vars(a), "device": device, "pdl_launched": effective, "machine": platform.platform(),
                "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows, "not_run": missing}, indent=1))
    return 0 if all(r["identical"] for r in rows) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
