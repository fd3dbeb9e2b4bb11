"""How far SWA bounded replay moves the logits (a measurement script).

Encoder side (`--side encoder`, the default): for each (prompt, seed) a cold engine and a
bounded-replay engine see the same first turn, then a longer second turn that hits the cache.
Decoder side (`--side decoder`, DeepSeek-V4.1): the same prompts through an engine with
`swa_bounded_replay` off (exact) and one with it on (layers after the last KV source run on each
sequence's last window only), prefix caching off. Either way we compare the logits of the first
generated tokens (teacher-forced on the exact run's tokens) relative to its logit scale.

    python -m engine.replay_error [--model DIR] [--side encoder|decoder] [--prompts 16] [--seeds 3]
                                  [--steps 8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams


def _logits_along(engine: LLMEngine, rid: str, prompt: list[int], forced: list[int] | None, steps: int):
    """Logits of `steps` generated positions; the request follows `forced` tokens if given."""
    engine.add_request(GenerationRequest(rid, prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=steps, temperature=0, ignore_eos=True)))
    seq = engine.scheduler.waiting[-1]
    rows = []
    while engine.has_unfinished():
        engine.step()
        if rid in engine.last_logits:
            rows.append(engine.last_logits[rid].double().clone())
            if forced is not None and len(seq.output_token_ids) <= len(forced):
                seq.output_token_ids[-1] = forced[len(seq.output_token_ids) - 1]  # follow the cold path
    return torch.stack(rows), list(seq.output_token_ids)


def measure(model: str, n_prompts: int, seeds: int, steps: int, first_len: int, extra_len: int,
            dtype: str = "float64", side: str = "encoder", **engine_args) -> dict:
    encoder = side == "encoder"
    if encoder:  # V4.1: isolate the encoder side (no effect on V4, which has no decoder side)
        engine_args = {"swa_decoder_trim": False, **engine_args}
    exact = {} if encoder else {"swa_bounded_replay": False}
    cold = LLMEngine({"model": model, "dtype": dtype, **engine_args, **exact})
    hot = LLMEngine({"model": model, "dtype": dtype, "enable_prefix_caching": encoder, **engine_args})
    vocab, errs, rel = cold.cfg.vocab_size, [], []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(1000 + seed)
        for i in range(n_prompts):
            first = torch.randint(5, vocab, (first_len + i,), generator=g).tolist()
            second = first + torch.randint(5, vocab, (extra_len,), generator=g).tolist()
            if encoder:
                _logits_along(hot, f"warm-{seed}-{i}", first, None, 1)  # fills the cache
            want, path = _logits_along(cold, f"cold-{seed}-{i}", second, None, steps)
            got, _ = _logits_along(hot, f"hot-{seed}-{i}", second, path, steps)
            scale = want.abs().max().item()
            e = (got - want).abs().max(dim=-1).values / scale
            errs.append(e.max().item())
            rel.append(e.mean().item())
    st = hot.stats()
    assert not encoder or st["prefix_cache_hits"] == n_prompts * seeds, st  # every second turn really hit
    return {"pairs": len(errs), "max_rel_err": max(errs), "mean_rel_err": statistics.fmean(rel),
            "p90_rel_err": sorted(errs)[int(0.9 * (len(errs) - 1))], "hits": st.get("prefix_cache_hits", 0),
            "hit_tokens": st.get("prefix_cache_hit_tokens", 0), "replayed_tokens": st.get("prefix_cache_replayed_tokens", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--first-len", type=int, default=70)
    ap.add_argument("--extra-len", type=int, default=20)
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--side", choices=("encoder", "decoder"), default="encoder")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    r = measure(a.model, a.prompts, a.seeds, a.steps, a.first_len, a.extra_len, a.dtype, a.side)
    print("pairs | max rel err | p90 rel err | mean rel err | hit tokens | replayed tokens")
    print(f"{r['pairs']} | {r['max_rel_err']:.3e} | {r['p90_rel_err']:.3e} | {r['mean_rel_err']:.3e} | "
          f"{r['hit_tokens']} | {r['replayed_tokens']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "result": r}, f, indent=2)


if __name__ == "__main__":
    main()
