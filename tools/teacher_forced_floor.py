"""The teacher-forced check's noise floor: how far two references that are both correct part on the same tokens.

On random weights at depth a small difference grows layer by layer and the next-token distributions are nearly
flat, so two valid bf16 implementations may part as far as the engine parts from its reference. The floor
measures that in the same run (tools/check_teacher_forced.py --floor), with the check's own scoring
(check_teacher_forced.score: top-1, KL, largest logit difference, near ties, the probes' per-layer error), on the
tokens the engine was fed, between pairs of references:

  1. float32 vs rounded: what bf16 storage and e4m3 activation quantization alone move;
  2. rounded vs reordered: the rounded reference against itself summing in another valid order (each
     contraction over its two halves of K, the partials added in float32; a token's expert rows added in reverse:
     kernels.reference.set_reordered), i.e. what summation order alone moves. The served kernels have exactly
     this freedom (the FP8 linear's split-K partials, a GEMM's K tiles, flash-decoding's key splits, the MoE's
     row sums) and round where the rounded reference does, so an engine whose only error is its kernels'
     order is expected near pair 2. It is a lower bound on the kernels' freedom: Hopper's FP8 tensor-core MMA
     keeps fewer accumulator bits than float32 (the DeepSeek-V3 report's finding) and fast exp / rsqrt round
     otherwise; neither is modelled here.
     V4.1's own ops (kernels/deepseek_v41/reference.py) keep torch's order; the ops it shares with V4 reorder.

Verdict: the engine's mean KL against the rounded reference within AT_FLOOR times pair 2's is "at the noise
floor"; above that, the engine's probes' jump layer is where to look. The targets stay as they are.

Cost: pair 1 scores each sequence through the float32 reference in one prefill (seconds each at V4-Flash
depth); pair 2 reads the tokens through the reordered reference in the engine's schedule (as long as the
rounded reference took); each pair's probe (one by default) runs its two references eagerly again. The engine
under test is freed first: at most two references are on the device at once (the rounded one and the pair's
other).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from engine.llm_engine import LLMEngine
from tools.check_teacher_forced import Fed, predictions, probe_line, score, summary_header, summary_line

FLOOR_PAIRS = (("float32", "rounded"), ("rounded", "reordered"))  # (reference, compared), each pair with rounded
AT_FLOOR = 2.0  # the engine's mean KL vs rounded within this factor of pair 2's: at the noise floor


def release() -> None:
    """Frees what the dropped engines held on the device (an engine holds reference cycles: collect first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def floor_pair(ref_kind: str, test_kind: str, rounded: LLMEngine, fed: Fed, build: Callable[[str], LLMEngine],
               probes: int, tie: float) -> dict:
    """One pair on fed.tokens; fed.want: the rounded reference's logits (the check against it computed them),
    the pair's other reference built here (and dropped on return)."""
    t0 = time.monotonic()
    other_kind = test_kind if ref_kind == "rounded" else ref_kind
    other = build(other_kind)
    logits = predictions(other, fed.prompts, fed.tokens)
    t_logits = time.monotonic() - t0
    sides = {"rounded": (rounded, fed.want), other_kind: (other, logits)}
    (ref, want), (test, got) = sides[ref_kind], sides[test_kind]
    print(f"noise floor, {ref_kind} vs {test_kind}: {len(got)} positions, {other_kind} {t_logits:.1f} s", flush=True)
    report = score(ref, test, Fed(fed.prompts, fed.tokens, want, got), probes, tie)
    return {"pair": f"{ref_kind} vs {test_kind}", **report,
            "seconds": {other_kind: round(t_logits, 1), "probes": round(time.monotonic() - t0 - t_logits, 1)}}


def noise_floor(fed: Fed, rounded: LLMEngine, build: Callable[[str], LLMEngine], probes: int = 1,
                tie: float = 1e-2) -> list[dict]:
    """Every pair of FLOOR_PAIRS on the tokens the check against the rounded reference fed (fed, its
    predictions in fed.want) -> one report each (score's, plus `pair` and `seconds`). build(kind): a reference
    of that kind, sized as the check's. One probe a pair by default: at depth a rounded reference's probe
    decodes its prompt alone up to the position, one dequantising forward per token."""
    pairs = []
    for ref_kind, test_kind in FLOOR_PAIRS:
        pairs.append(floor_pair(ref_kind, test_kind, rounded, fed, build, probes, tie))
        release()
    return pairs


def floor_verdict(engine: dict, pairs: list[dict]) -> dict:
    """The engine's report against the rounded reference, judged by the summation-order pair's mean KL."""
    order = next(p for p in pairs if p["pair"] == "rounded vs reordered")
    kl, floor = engine["mean_kl"], order["mean_kl"]
    ratio = kl / floor if floor > 0 else (1.0 if kl == 0 else None)  # None: above a floor of exactly 0
    at_floor = ratio is not None and ratio <= AT_FLOOR
    jumps = sorted({p["jump"] for p in engine["probes"]})
    times = "an unbounded factor" if ratio is None else f"{ratio:.3g}x"
    text = (f"at the noise floor: the engine's mean KL against the rounded reference is {times} what summation "
            f"order alone moves (<= {AT_FLOOR:g}x)" if at_floor else
            f"above the floor ({times} what summation order alone moves, > {AT_FLOOR:g}x): look at the probe's "
            f"jump layer ({', '.join(map(str, jumps)) or 'no probe'})")
    return {"engine_mean_kl": kl, "floor_mean_kl": floor, "ratio": ratio, "at_floor_factor": AT_FLOOR,
            "at_floor": at_floor, "verdict": text}


def print_floor(pairs: list[dict], engine: dict, judged: dict) -> None:
    print(f"noise floor: correct references against each other on the engine's tokens ({engine['positions']} "
          f"positions), beside the engine against the rounded reference")
    print(summary_header("pair", 20))
    for p in pairs:
        print(summary_line(p["pair"], p, 20))
    print(summary_line("engine vs rounded", engine, 20))
    for p in pairs:
        for probe in p["probes"]:
            print(f"{p['pair']}: {probe_line(probe)}")
    print(f"floor verdict: {judged['verdict']}; floor seconds {[p['seconds'] for p in pairs]}")
