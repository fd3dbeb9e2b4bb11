"""Teacher-forced check: the engine as served against the torch references, on one token sequence.

The engine under test (the engine arguments as given: fused kernels, CUDA graphs, paged KV cache; on the
CPU the decode graphs' static batches) reads 8 prompts together and continues them for --steps tokens,
one decode step per token. The reference (the same checkpoint, every op its torch reference in float32,
weights dequantised to float32 as they are used, eager) then reads each prompt plus those tokens in one
prefill and gives the next-token logits of every position: both predict every position from the same
history, so a rounding flip cannot send them down different paths. `--teacher reference` instead lets
the reference decode greedily and feeds its tokens to the engine (the engine's own picks overwritten
before each next step): the same comparison, but the reference then pays one dequantising forward per
token (minutes at V4-Flash depth against seconds).

Two references (--reference, both by default, one report each): `float32` (every activation float32: what the
model computes) and `rounded` (the same references in a float32 model, rounding to bf16 where the served kernels
store an activation and quantizing to e4m3 where the served FP8 GEMM does: kernels.reference.set_rounding). The
rounded reference reads the tokens in the engine's own schedule (the prompts' prefill together, then one decode
step per position: the same rows per linear, so the same kernel variants and roundings), never in one prefill.
Against it only the kernels' own error is left (accumulation order, in-register roundings): a kernel bug shows
there, where against float32 it hides in the storage's rounding drift.

Per position: top-1 agreement, KL(reference || engine) of the next-token distributions, the largest
logit difference; a disagreement where the reference's top two are within --tie nats is counted apart
(a near tie). Then at the first positions where they part (or, if none, the largest KL) the prompt runs
alone through both, eagerly (the engine decoding one token per step, the reference in one prefill up to
the position), with taps on every layer:
the residual streams' relative error layer by layer, so a bug shows as one layer whose error jumps,
rounding as a gradual drift (`jump`: the layer adding the most; `route_flips`: the layers whose routed
experts differ, where rounding alone can make a jump).

--floor: then the noise floor (tools/teacher_forced_floor.py): the same scores between references that are all
correct, on the same tokens (float32 vs rounded: what storage moves; rounded vs `reordered`, the rounded references
summing in another valid order: what summation order alone moves), and a verdict: the engine against the rounded
reference "at the noise floor" (within 2x of the second pair's mean KL) or above it.

Memory: both models stay as stored (FP8 / MXFP4); the reference dequantises each weight to float32 when
it is used, so it needs no float32 copy of the model (its activations and KV cache are float32).

    python -m tools.check_teacher_forced --model DIR [--prompts 8] [--steps 256] [--probes 2]
        [--reference float32,rounded] [--floor] [--teacher engine|reference] [--engine-args JSON]
        [--perturb-layer N] [--oracle] [--json F]

Exit status 1 when a target is missed (top-1 agreement >= --min-agreement, mean KL <= --max-mean-kl) against
any reference; with --perturb-layer N (a planted bug), 1 unless every probe names layer N as the jump.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams
from engine.runner import decode_buckets
from tools.bench_engine import random_prompts
from tools.layer_taps import EMBED, LayerTaps, eager_steps

# The references: every op its torch reference, in a float32 model, eager; `rounded` rounds as the kernels store;
# `reordered` is `rounded` summing in another valid order (the noise floor's, tools/teacher_forced_floor.py)
BACKEND_OF = {"float32": "ref", "rounded": "rounded", "reordered": "reordered"}  # kind -> kernels backend
REFERENCES = {kind: {"dtype": "float32", "kernels": backend, "enforce_eager": True,
                     "swa_decoder_trim": False}  # V4.1: every row through every layer (the trim approximates)
              for kind, backend in BACKEND_OF.items()}
# Both engines: tokens read back every step (so the next one can be forced), no prefix cache (a probe
# feeds a prompt again: it must run the same path, not a cache hit)
FORCEABLE = {"async_scheduling": False, "enable_prefix_caching": False}
KV_BYTES_CUDA = 4 << 30  # per engine: 8 sequences of a few hundred tokens; two engines share the GPU


@contextmanager
def kernels_of(engine: LLMEngine):
    """The kernels backend is process-wide: each engine runs under its own."""
    before = kernels.backend()
    kernels.set_backend(engine.args.kernels)
    try:
        yield
    finally:
        kernels.set_backend(before)


def _sized(model: str, n_prompts: int, max_len: int) -> dict:
    common = {"model": model, "max_model_len": max_len, "max_num_seqs": n_prompts, **FORCEABLE}
    if torch.cuda.is_available():
        common["kv_cache_memory_bytes"] = KV_BYTES_CUDA
    return common


def _engine(args: dict) -> LLMEngine:
    """An engine built without leaving its kernels backend set process-wide (its constructor sets it; each use
    sets it again through kernels_of)."""
    before = kernels.backend()
    try:
        return LLMEngine(args, detokenize=False)
    finally:
        kernels.set_backend(before)


def build_reference(model: str, n_prompts: int, max_len: int, engine_args: dict, kind: str = "float32") -> LLMEngine:
    """The reference of that kind (REFERENCES), sized as the engine under test; `rounded` and `reordered` also
    take its scheduling arguments (they must cut the same steps)."""
    common = _sized(model, n_prompts, max_len)
    same_steps = engine_args if BACKEND_OF[kind] in kernels.ROUNDED else {}
    return _engine({**common, **same_steps, **REFERENCES[kind], **FORCEABLE})


def build_engines(model: str, n_prompts: int, max_len: int, engine_args: dict,
                  reference: str = "float32") -> tuple[LLMEngine, LLMEngine]:
    """(reference, engine under test), both sized for n_prompts sequences of max_len tokens."""
    ref = build_reference(model, n_prompts, max_len, engine_args, reference)
    test = _engine({**_sized(model, n_prompts, max_len), **engine_args, **FORCEABLE})
    if test.device.type == "cpu":  # decode steps on exactly what a graph replay reads
        test.runner.static_decode_batches(decode_buckets(n_prompts))
    return ref, test


def in_engine_steps(ref: LLMEngine) -> bool:
    """Whether this reference must read the tokens in the engine's schedule (the rounded ones: their roundings
    depend on each step's rows) rather than score each sequence in one prefill."""
    return ref.args.kernels in kernels.ROUNDED


def kind_of(ref: LLMEngine) -> str:
    """The reference's kind (a key of REFERENCES) from its kernels backend."""
    return next(kind for kind, backend in BACKEND_OF.items() if backend == ref.args.kernels)


_runs = iter(range(1 << 30))


def run_forced(engine: LLMEngine, prompts: list[list[int]], steps: int, forced: list[list[int]] | None,
               on_logits: Callable[[int, int, torch.Tensor], None]) -> list[list[int]]:
    """Feed the prompts together, then `steps` positions each, one decode step per position; the token
    fed after position k is forced[i][k] (None: the engine's own greedy pick). on_logits(prompt, k,
    logits) sees each next-token distribution. -> the tokens fed after each prompt."""
    run = next(_runs)
    seqs = [engine.add_request(GenerationRequest(f"forced-{run}-{i}", prompt_token_ids=p, sampling=SamplingParams(
        max_tokens=steps, temperature=0, ignore_eos=True))) for i, p in enumerate(prompts)]
    with kernels_of(engine):
        while engine.has_unfinished():
            before = [len(s.output_token_ids) for s in seqs]
            engine.step()
            for i, (s, k) in enumerate(zip(seqs, before)):
                if len(s.output_token_ids) > k:  # this step predicted position k of prompt i
                    on_logits(i, k, engine.last_logits[s.request_id])
                    if forced is not None:
                        s.output_token_ids[k] = forced[i][k]
    return [list(s.output_token_ids) for s in seqs]


def score_sequence(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The next-token logits [len(ids), vocab] of every position of one sequence, read in its prefill
    (the runner asked for every row's logits; the engine still gets the last row it samples from)."""
    rows: list[torch.Tensor] = []
    run = engine.runner.run

    def every_row(scheduled, all_logits=False, **kwargs):
        out = run(scheduled, all_logits=True, **kwargs)
        rows.append(out.float().cpu())
        (seq, n), = scheduled
        return out[-1:] if seq.num_computed_tokens + n == seq.num_tokens else out[:0]

    engine.runner.run = every_row  # an instance attribute over the method, for this one request
    try:
        run_forced(engine, [ids], 1, None, lambda *_: None)
    finally:
        del engine.runner.run
    return torch.cat(rows)


def compare_row(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """One position: the two next-token distributions from their logits."""
    ref, got = ref.double().cpu(), got.double().cpu()
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    top2 = lp_ref.topk(2).values
    return {"agree": bool(ref.argmax() == got.argmax()),
            "kl": float((lp_ref.exp() * (lp_ref - lp_got)).sum().clamp(min=0)),
            "max_logit_diff": float((got - ref).abs().max()), "margin": float(top2[0] - top2[1])}


def summarize(rows: list[dict], tie: float) -> dict:
    kl = torch.tensor([r["kl"] for r in rows], dtype=torch.float64)
    parted = [r for r in rows if not r["agree"]]
    return {"positions": len(rows), "top1_agreement": 1 - len(parted) / len(rows),
            "near_tie_disagreements": sum(r["margin"] < tie for r in parted),
            "mean_kl": float(kl.mean()), "p99_kl": float(kl.quantile(0.99)), "max_kl": float(kl.max()),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows)}


def probe_positions(rows: list[dict], n: int) -> list[dict]:
    """The first n positions (by step) where the top-1 parts; none: the largest KL."""
    parted = sorted((r for r in rows if not r["agree"]), key=lambda r: (r["step"], r["prompt"]))
    return parted[:n] if parted else [max(rows, key=lambda r: r["kl"])] if n else []


def decode_states(engine: LLMEngine, prompt: list[int], tokens: list[int], at: set[int]) -> dict[int, dict]:
    """The prompt alone, then forced along `tokens` one decode step each, eagerly: step -> the taps'
    rows and routes and the logits, at the steps in `at`."""
    out: dict[int, dict] = {}
    with eager_steps(engine.runner), LayerTaps(engine.model) as taps:
        def keep(_, k, logits):
            if k in at:
                out[k] = {"layers": dict(taps.rows), "routes": dict(taps.routes), "logits": logits.float().cpu()}
        run_forced(engine, [prompt], max(at) + 1, [tokens], keep)
    return out


def prefill_states(engine: LLMEngine, ids: list[int]) -> dict:
    """One prefill of `ids`: the taps' rows and routes of its last row, and its next-token logits."""
    out: dict = {}
    with eager_steps(engine.runner), LayerTaps(engine.model) as taps:
        run_forced(engine, [ids], 1, None, lambda _, k, logits: out.update(
            layers=dict(taps.rows), routes=dict(taps.routes), logits=logits.float().cpu()))
    return out


def layer_errors(ref: dict, got: dict) -> dict:
    """Relative error of the streams after each layer; `jump`: the layer that adds the most error;
    `route_flips`: the layers whose routed experts differ (a jump there may be rounding's, not a bug)."""
    a, b = ref["layers"], got["layers"]
    errs = {k: float((b[k] - a[k]).norm() / a[k].norm().clamp(min=1e-30)) for k in sorted(a)}
    blocks = [k for k in errs if k != EMBED]
    added = {k: errs[k] - errs.get(k - 1, errs[EMBED]) for k in blocks}
    jump = max(added, key=added.get)
    flips = [k for k in blocks if ref["routes"][k] != got["routes"][k]]
    return {"embed": errs[EMBED], "layers": [errs[k] for k in blocks], "jump": jump, "jump_added": added[jump],
            "route_flips": flips}


def oracle_rows(model_dir: str, prompts: list[list[int]], tokens: list[list[int]],
                ref_logits: dict[tuple[int, int], torch.Tensor]) -> list[dict]:
    """The float32 reference against transformers' DeepseekV4ForCausalLM (the external oracle; FP8 /
    MXFP4 dequantised to float32 by FineGrainedFP8Config) on the same sequences, one forward each."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    from engine.args import resolve_model_dir
    from engine.models.registry import load_config

    path = resolve_model_dir(model_dir)
    cfg = load_config(path)
    stored = cfg.fp8_linears or cfg.expert_dtype != "bf16"
    quantized = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if stored else {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), experts_implementation="eager", dtype=torch.float32,
                                               **quantized).to(device).eval()
    rows = []
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, tokens)):
            logits = hf(torch.tensor([p + t[:-1]], device=device)).logits[0, len(p) - 1:]
            rows += [{"prompt": i, "step": k, **compare_row(logits[k], ref_logits[(i, k)])} for k in range(len(t))]
    return rows


@dataclass
class Fed:
    """What a check fed both engines and what each predicted: tokens[i] after prompts[i]; want (the reference's)
    and got (the engine's): (prompt, position) -> the next-token logits, float32 on the host."""
    prompts: list[list[int]]
    tokens: list[list[int]]
    want: dict[tuple[int, int], torch.Tensor]
    got: dict[tuple[int, int], torch.Tensor]


def _into(store: dict) -> Callable[[int, int, torch.Tensor], None]:
    return lambda i, k, logits: store.__setitem__((i, k), logits.float().cpu())


def predictions(ref: LLMEngine, prompts: list[list[int]], tokens: list[list[int]]) -> dict[tuple[int, int], torch.Tensor]:
    """A reference's next-token logits along the given tokens: in the engine's schedule (its prefill, then one
    decode step per position) where it rounds as the kernels do, else each sequence in one prefill."""
    want: dict[tuple[int, int], torch.Tensor] = {}
    if in_engine_steps(ref):
        run_forced(ref, prompts, len(tokens[0]), tokens, _into(want))
        return want
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        scored = score_sequence(ref, p + t[:-1])[len(p) - 1:]
        want.update(((i, k), scored[k]) for k in range(len(t)))
    return want


def score(ref: LLMEngine, test: LLMEngine, fed: Fed, probes: int = 2, tie: float = 1e-2) -> dict:
    """How far test's predictions (fed.got) part from ref's (fed.want) on the same tokens: per position, along
    the steps, and at the first partings (or the largest KL) layer by layer, each engine run again eagerly (test
    decoding one token per step, ref the same where it rounds as the kernels do, else in one prefill). The report
    of the module's docstring, less the timings."""
    prompts, tokens, want, got = fed.prompts, fed.tokens, fed.want, fed.got
    steps = len(tokens[0])
    rows = [{"prompt": i, "step": k, **compare_row(want[i, k], got[i, k])} for i, k in sorted(got)]
    report = summarize(rows, tie) | {"prompts": len(prompts), "steps": steps, "reference": kind_of(ref),
                                     "prompt_lens": [len(p) for p in prompts]}
    # drift along the sequence: mean KL and agreement per span of steps
    spans = [(0, 1), (1, 16), (16, 64), (64, steps)]
    report["by_step"] = [{"steps": f"{a}-{b - 1}", **summarize(sel, tie)}
                         for a, b in spans if (sel := [r for r in rows if a <= r["step"] < b])]
    print(f"  top-1 {report['top1_agreement']:.2%}, mean KL {report['mean_kl']:.2e}", flush=True)
    report["probes"] = []
    wanted = probe_positions(rows, probes)
    for i in sorted({p["prompt"] for p in wanted}):
        at = {p["step"] for p in wanted if p["prompt"] == i}
        print(f"  probing prompt {i} at steps {sorted(at)} layer by layer", flush=True)
        test_at = decode_states(test, prompts[i], tokens[i], at)
        ref_steps = decode_states(ref, prompts[i], tokens[i], at) if in_engine_steps(ref) else {}
        for k in sorted(at):
            ref_at = ref_steps.get(k) or prefill_states(ref, prompts[i] + tokens[i][:k])
            row = next(r for r in rows if r["prompt"] == i and r["step"] == k)
            alone = compare_row(ref_at["logits"], test_at[k]["logits"])  # the same position, batch 1, eager
            report["probes"].append({"prompt": i, "step": k, "agree": row["agree"], "kl": row["kl"],
                                     "margin": row["margin"], "alone_kl": alone["kl"], "alone_agree": alone["agree"],
                                     **layer_errors(ref_at, test_at[k])})
    return report


def check(ref: LLMEngine, test: LLMEngine, prompts: list[list[int]], steps: int, probes: int = 2,
          tie: float = 1e-2, oracle: bool = False, teacher: str = "engine") -> tuple[dict, Fed]:
    """The whole check on two built engines -> (the report of the module's docstring, what was fed and
    predicted). teacher: whose greedy tokens both are fed; oracle: also the reference against transformers
    (`oracle_rows`)."""
    t0 = time.monotonic()
    want: dict[tuple[int, int], torch.Tensor] = {}  # (prompt, step) -> the reference's logits
    got: dict[tuple[int, int], torch.Tensor] = {}  # the engine's
    if teacher == "reference":
        tokens = run_forced(ref, prompts, steps, None, _into(want))
        t_ref = time.monotonic() - t0
        fed_tokens = run_forced(test, prompts, steps, tokens, _into(got))
        assert fed_tokens == tokens, "the engine under test was not fed the reference's tokens"
        t_test = time.monotonic() - t0 - t_ref
    else:
        tokens = run_forced(test, prompts, steps, None, _into(got))
        t_test = time.monotonic() - t0
        want = predictions(ref, prompts, tokens)
        t_ref = time.monotonic() - t0 - t_test
    print(f"  {len(got)} positions: engine {t_test:.1f} s, reference {t_ref:.1f} s", flush=True)
    fed = Fed(prompts, tokens, want, got)
    report = score(ref, test, fed, probes, tie) | {"teacher": teacher}
    report["seconds"] = {"reference": round(t_ref, 1), "engine": round(t_test, 1),
                         "probes": round(time.monotonic() - t0 - t_ref - t_test, 1)}
    if oracle:
        t1 = time.monotonic()
        report["oracle"] = summarize(oracle_rows(ref.args.model, prompts, tokens, want), tie)
        report["seconds"]["oracle"] = round(time.monotonic() - t1, 1)
    return report, fed


def switch_names(spec: str) -> list[str]:
    """--switches: "all" (pdl and every fusion), or names: "pdl", a fusion of kernels/fusions.py, a kernel variant of
    kernels/variants.py (turned on over the default variants) or "no_" and a default one (turned off)."""
    from kernels import fusions, variants

    if spec == "all":
        return ["pdl", *fusions.ALL]
    names = spec.split(",")
    known = {"pdl", *fusions.ALL, *variants.ALL, *(f"no_{v}" for v in variants.DEFAULT)}
    if bad := [n for n in names if n not in known]:
        raise ValueError(f"unknown switches {bad}: pdl, a fusion {fusions.ALL}, a variant {variants.ALL}, or no_ and "
                         f"a default variant {variants.DEFAULT}")
    return names


def switched(engine: LLMEngine, name: str) -> None:
    """The engine under test with one decode switch alone ("base": none, the default variants; "pdl": kernels/pdl.py;
    a fusion of kernels/fusions.py; a kernel variant on, or "no_" one of the default variants off), its decode graphs
    captured again (they hold the kernels at capture)."""
    from kernels import fusions, pdl, variants
    from tools.bench_decode_switches import recapture

    pdl.set_enabled(name == "pdl")
    fusions.set_fusions((name,) if name in fusions.ALL else ())
    on = set(variants.DEFAULT) - {name.removeprefix("no_")} if name.startswith("no_") else \
        set(variants.DEFAULT) | ({name} if name in variants.ALL else set())
    variants.set_variants(tuple(v for v in variants.ALL if v in on))
    for size in sorted(engine.runner.graphs) or ([] if torch.cuda.is_available() else
                                                 decode_buckets(engine.args.max_num_seqs)):
        recapture(engine.runner, size)


def switch_verdicts(ref: LLMEngine, test: LLMEngine, prompts: list[list[int]], steps: int, names: list[str],
                    slack: float = 1.25) -> list[dict]:
    """Each decode switch alone against the path without it and against the (rounded) reference, all fed the
    base path's greedy tokens (prefill, then one decode step per position, graphs as served). A switch whose
    mean KL to the reference is within `slack` times the base path's only rounds differently ("rounding");
    past it "wrong", with the layer the per-layer probe (the first parting position, else the largest KL)
    sees jump. PDL changes the order of launches, not arithmetic: its logits must equal the base's."""
    logits: dict[str, dict] = {}
    switched(test, "base")
    tokens = run_forced(test, prompts, steps, None, _into(logits.setdefault("base", {})))
    want: dict = {}
    run_forced(ref, prompts, steps, tokens, _into(want))
    base_rows = [{"prompt": i, "step": k, **compare_row(want[i, k], logits["base"][i, k])} for i, k in sorted(want)]
    out = [{"switch": "base", **summarize(base_rows, 1e-2), "vs_base_max_dlogit": 0.0, "verdict": "-"}]
    for name in names:
        switched(test, name)
        got = logits.setdefault(name, {})
        run_forced(test, prompts, steps, tokens, _into(got))
        rows = [{"prompt": i, "step": k, **compare_row(want[i, k], got[i, k])} for i, k in sorted(want)]
        r = summarize(rows, 1e-2)
        dmax = max(float((got[key] - logits["base"][key]).abs().max()) for key in got)
        if name == "pdl":
            verdict = "identical" if dmax == 0 else f"differs by {dmax:.3g}"
        elif r["mean_kl"] <= slack * out[0]["mean_kl"]:
            verdict = "rounding"
        else:
            (probe,) = probe_positions(rows, 1)
            i, k = probe["prompt"], probe["step"]
            errs = layer_errors(decode_states(ref, prompts[i], tokens[i], {k})[k],
                                decode_states(test, prompts[i], tokens[i], {k})[k])
            verdict = f"wrong: layer {errs['jump']}"
        out.append({"switch": name, **r, "vs_base_max_dlogit": dmax, "verdict": verdict})
        print(f"  {name}: {verdict}", flush=True)
    switched(test, "base")
    return out


def print_verdicts(rows: list[dict], reference: str) -> None:
    print(f"decode switches alone vs the base path and the {reference} reference (same tokens):")
    print(f"{'switch':>16} | {'top-1':>7} | {'mean KL':>9} | {'max KL':>9} | {'dlogit vs base':>14} | verdict")
    for r in rows:
        print(f"{r['switch']:>16} | {r['top1_agreement']:7.2%} | {r['mean_kl']:9.2e} | {r['max_kl']:9.2e} | "
              f"{r['vs_base_max_dlogit']:14.3e} | {r['verdict']}")


def perturb_layer(engine: LLMEngine, layer: int, scale: float) -> None:
    """Scale one layer's FFN norm weight on the engine's side (a planted bug the check must find; the
    attention's would mostly vanish in the q and kv norms after its first linears)."""
    w = engine.model.layers[layer].ffn_norm.weight
    with torch.no_grad():
        w.mul_(scale)


def summary_header(first: str, width: int = 8) -> str:
    return (f"{first:>{width}} | {'top-1':>7} | {'mean KL':>9} | {'p99 KL':>9} | {'max KL':>9} | {'max dlogit':>10} | "
            "near ties")


def summary_line(label: str, s: dict, width: int = 8) -> str:
    """One `summarize` result as a row of summary_header's table."""
    return (f"{label:>{width}} | {s['top1_agreement']:7.2%} | {s['mean_kl']:9.2e} | {s['p99_kl']:9.2e} | "
            f"{s['max_kl']:9.2e} | {s['max_logit_diff']:10.3e} | {s['near_tie_disagreements']}")


def probe_line(p: dict) -> str:
    """One probe of a report: where the two part, layer by layer."""
    errs = " ".join(f"{e:.1e}" for e in p["layers"])
    return (f"probe prompt {p['prompt']} step {p['step']} ({'agree' if p['agree'] else 'parted'}, KL {p['kl']:.2e}, "
            f"margin {p['margin']:.2e}; alone KL {p['alone_kl']:.2e}): jump at layer {p['jump']} "
            f"(+{p['jump_added']:.2e}); routing flips at layers {p['route_flips']}; embed {p['embed']:.1e}; "
            f"layers {errs}")


def print_report(r: dict, targets: dict) -> None:
    print(f"teacher-forced: {r['prompts']} prompts x {r['steps']} positions, engine vs {r['reference']} references")
    print(summary_header("steps"))
    for s in r["by_step"] + [{**r, "steps": "all"}]:
        print(summary_line(s["steps"], s))
    for p in r["probes"]:
        print(probe_line(p))
    if "oracle" in r:
        o = r["oracle"]
        print(f"reference vs transformers (oracle): top-1 {o['top1_agreement']:.2%}, mean KL {o['mean_kl']:.2e}, "
              f"max KL {o['max_kl']:.2e}, max dlogit {o['max_logit_diff']:.3e}")
    verdict = ", ".join(f"{k} {'ok' if ok else 'MISSED'}" for k, ok in targets.items())
    print(f"targets: {verdict}; seconds {r['seconds']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint directory ('' : the tiny checkpoint)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="the first prompt's tokens; each next one 29 more")
    ap.add_argument("--steps", type=int, default=256, help="forced positions per prompt")
    ap.add_argument("--probes", type=int, default=2, help="parting positions to trace layer by layer")
    ap.add_argument("--tie", type=float, default=1e-2, help="a disagreement within this reference margin (nats) "
                    "is a near tie")
    ap.add_argument("--teacher", choices=("engine", "reference"), default="engine", help="whose greedy tokens "
                    "both are fed: the engine's (the reference scores them in one prefill) or the reference's "
                    "(it decodes them: one forward per token)")
    ap.add_argument("--reference", default="float32,rounded", help="the references to compare with, in order: "
                    "float32 (scores each sequence in one prefill), rounded (rounds as the served kernels store; "
                    "reads the tokens in the engine's schedule), reordered (rounded, summing in another order)")
    ap.add_argument("--floor", action="store_true", help="then the noise floor (tools/teacher_forced_floor.py): "
                    "the same scores between correct references on the same tokens (float32 vs rounded, rounded "
                    "vs reordered) and whether the engine against the rounded reference is within 2x of the "
                    "second; needs rounded in --reference; costs a float32 prefill per prompt and a second "
                    "rounded reference's run")
    ap.add_argument("--engine-args", default="{}", help="the engine under test's arguments (JSON)")
    ap.add_argument("--perturb-layer", type=int, default=None, help="scale this layer's FFN norm on the "
                    "engine's side by --perturb-scale: the per-layer report must point at it")
    ap.add_argument("--perturb-scale", type=float, default=1.5)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--max-mean-kl", type=float, default=1e-3)
    ap.add_argument("--oracle", action="store_true", help="also compare the reference with transformers' "
                    "DeepseekV4ForCausalLM (V4 only; float32 weights: where they fit)")
    ap.add_argument("--switches", default="", help="instead of the check: each decode switch alone (pdl, a "
                    "fusion of kernels/fusions.py, a kernel variant on or no_VARIANT off, or 'all': pdl and every "
                    "fusion) against the base path and the first --reference: rounding or wrong, and where "
                    "(switch_verdicts); exit 1 if any is wrong")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    kinds = a.reference.split(",")
    if not kinds or any(k not in REFERENCES for k in kinds):
        ap.error(f"--reference takes a comma-separated list of {tuple(REFERENCES)}, got {a.reference!r}")
    if a.floor and "rounded" not in kinds:
        ap.error("--floor judges the engine against the rounded reference: --reference must include rounded")
    if a.floor and a.switches:
        ap.error("--floor is for the check, not --switches")
    try:
        names = switch_names(a.switches) if a.switches else []
    except ValueError as e:
        ap.error(str(e))
    lens = [a.prompt_len + 29 * i for i in range(a.prompts)]
    engine_args, max_len = json.loads(a.engine_args), max(lens) + a.steps + 1
    order = sorted(kinds, key=lambda k: a.floor and k == "rounded")  # with --floor rounded last: the floor keeps it
    ref, test = build_engines(a.model, a.prompts, max_len, engine_args, order[0])
    prompts = [p[:n] for p, n in zip(random_prompts(a.prompts, max(lens), ref.cfg.vocab_size, a.seed), lens)]
    if a.perturb_layer is not None:
        perturb_layer(test, a.perturb_layer, a.perturb_scale)
    if a.switches:
        rows = switch_verdicts(ref, test, prompts, a.steps, names)
        print_verdicts(rows, kinds[0])
        if a.json:
            Path(a.json).write_text(json.dumps({"argv": vars(a), "switches": rows}, indent=2, default=str))
        return 0 if all(r["verdict"] in ("-", "rounding", "identical") for r in rows) else 1
    reports, targets = {}, {}
    for kind in order:
        if ref is None:  # one reference on the device at a time
            ref = build_reference(a.model, a.prompts, max_len, engine_args, kind)
        r, fed = check(ref, test, prompts, a.steps, a.probes, a.tie, a.oracle and kind == "float32", a.teacher)
        reports[kind] = r
        mine = {f"{kind}: top-1 >= {a.min_agreement:.0%}": r["top1_agreement"] >= a.min_agreement,
                f"{kind}: mean KL <= {a.max_mean_kl:.0e}": r["mean_kl"] <= a.max_mean_kl}
        if a.perturb_layer is not None:  # a planted bug: the question is whether the probes find it
            mine = {f"{kind}: every probe names layer {a.perturb_layer}": all(p["jump"] == a.perturb_layer
                                                                              for p in r["probes"])}
        print_report(r, mine)
        targets.update(mine)
        if a.floor and kind == "rounded":  # the floor starts from this reference and its predictions
            rounded, rounded_fed = ref, fed
        ref = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    meta = {"model": a.model, "engine_args": test.args.__dict__, "argv": vars(a), "machine": platform.platform(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "graphs": bool(test.runner.graphs), "kernels": test.args.kernels}
    floor = {}
    if a.floor:
        from tools.teacher_forced_floor import floor_verdict, noise_floor, print_floor, release

        test = None  # the floor needs the engine's tokens, not the engine: two references on the device at most
        release()
        pairs = noise_floor(rounded_fed, rounded, lambda kind: build_reference(
            a.model, a.prompts, max_len, engine_args, kind), tie=a.tie)
        rounded = None
        floor = {"floor": {"pairs": pairs, **floor_verdict(reports["rounded"], pairs)}}
        print_floor(pairs, reports["rounded"], floor["floor"])
    if a.json:
        first = reports[kinds[0]]  # the first reference's report at the top level, as before; each under its name
        Path(a.json).write_text(json.dumps({"meta": meta, "targets": targets, **first, "references": reports,
                                            **floor}, indent=2, default=str))
        print(f"wrote {a.json}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
