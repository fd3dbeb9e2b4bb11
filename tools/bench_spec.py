"""Speculative decoding with the MTP layer: step times, the speed-up they allow, and end to end.

One engine (speculative_config k = 3, CUDA graphs for its plain steps) on a random checkpoint:

1. micro: at batch B, with B requests prefilled (input_len tokens), CUDA-synchronised medians of
   the plain decode step (graph replay), the verify forward of k + 1 tokens per sequence (its
   CUDA graph, engine/spec/verify_graphs.py, and eager), the MTP's graph for k drafts
   (engine/spec/draft_graphs.py) and eagerly the MTP over k + 1 rows (its catch-up) and one chained
   draft step (one row per sequence);
2. model: from those, the speed-up at a per-token acceptance rate a:
   E[tokens per step] = (1 - a^(k+1)) / (1 - a), cost = verify + the MTP's work (graphed: the two
   graphs; eager: verify + catch-up + (k - 1) drafts), speed-up = E[tokens] x plain / cost;
3. end to end, decode tokens/s (after the prefills) at the two ends random weights allow: the
   random MTP's own drafts (acceptance ~0: the pure overhead) and drafts forced to agree (the
   outputs of that speculative run replayed as drafts: acceptance ~1), against plain decoding.

`--method dspark` (a 0731 checkpoint: `make_tiny_checkpoint --layout 0731`) measures DSpark instead
(engine/spec/dspark.py, docs/DSPARK.md), as served: k = the checkpoint's whole block (5), verify,
rollback and drafter steps replayed as CUDA graphs (engine/spec/dspark_graphs.py). Micro: the
plain step, the verify forward with the target features of k + 1 tokens per sequence (k = 1, 2, 3
and the block; graph and eager), the rollback graph, the drafter's step (every verify row's context
keys + the three stages + Markov and confidence heads for every sequence's block; graph, as the
decoder launches and reads it, and eager), and one stage over one row per sequence as a graph (the
shape of an MTP draft step: the proxy the model uses for MTP on the same model); the modelled
speed-up at mean acceptance lengths 2, 3, 4.4 and 5.4 against MTP k = 1 and 3; end to end with the
drafter's own drafts (acceptance ~0 on random weights: the overhead, every step rolling back) and
forced ones (acceptance ~1).

Prints tables, writes JSON (--json). Needs CUDA for meaningful numbers (runs on CPU for a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from types import SimpleNamespace

import torch

from engine.graphs.capture import capture
from engine.llm import LLM
from engine.models.deepseek_v4.random_checkpoint import PRESETS, QUANTS
from engine.request import GenerationRequest, SamplingParams
from engine.spec.draft_graphs import DraftGraphs
from engine.spec.dspark_graphs import DSparkGraphs
from engine.spec.verify_graphs import VerifyGraphs
from tools.bench_engine import random_prompts, resolve_model
from tools.kernel_device import sync

ALPHAS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _prefill(eng, batch: int, input_len: int, output_len: int, tag: str, seed: int) -> list[str]:
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = []
    for i, prompt in enumerate(random_prompts(batch, input_len, eng.cfg.vocab_size, seed=seed)):
        rid = f"{tag}-{i}"
        eng.add_request(GenerationRequest(rid, prompt_token_ids=prompt, sampling=sp))
        ids.append(rid)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    return ids


def micro(eng, spec, batch: int, input_len: int, reps: int) -> dict:
    """Step times on live sequences (their caches are scribbled on; they are aborted after)."""
    saved, eng.spec = eng.spec, None
    ids = _prefill(eng, batch, input_len, eng.max_model_len - input_len - 8, f"micro-{batch}", seed=batch)
    eng.flush()
    seqs = [eng.requests[r].seq for r in ids]
    model, runner, cache = eng.model, eng.runner, eng.cache
    for s in seqs:  # the next position's block (a prompt ending on a block boundary has none yet)
        cache.allocate(s.blocks, eng.scheduler._window_lo(s), s.num_computed_tokens + 1)
    row = {"batch": batch, "plain_ms": _median_ms(lambda: runner.run([(s, 1) for s in seqs]), reps)}
    for k in (1, 2, 3):
        for s in seqs:
            s.spec_token_ids = [s.last_token_id] * k
            # the verify's k + 1 positions, then the chained drafts' k - 1 after them
            cache.allocate(s.blocks, eng.scheduler._window_lo(s), s.num_computed_tokens + 2 * k)
        batch_k = [(s, 1 + k) for s in seqs]

        def verify():
            fb = runner.build_batch(batch_k)
            return model.compute_logits(model.hidden_states(fb, cache)[fb.logits_rows])

        row[f"verify_k{k}_eager_ms"] = _median_ms(verify, reps)
        # the verify graph of this batch bucket: the engine's own for its k, one captured here for the others
        own = spec.verify_steps is not None and k == spec.k and batch in spec.verify_steps.static
        pool = torch.cuda.graph_pool_handle() if spec.verify_steps is not None else None
        vs = spec.verify_steps if own else VerifyGraphs(model, cache, eng.max_model_len, k, [batch], pool)
        ds = spec.draft_steps if own else DraftGraphs(spec.mtp, model, spec.mtp_cache, vs, pool)
        row[f"verify_k{k}_ms"] = _median_ms(lambda vs=vs: vs.run(batch_k), reps)
        # the MTP's graph after it, every draft accepted: catch-up over k + 1 rows, k - 1 chained steps
        rows0 = [i * (k + 1) for i in range(batch)]
        items = {i: (rows0[i], [s.last_token_id] * (k + 1)) for i, s in enumerate(seqs)}
        chain = {i: (s.num_computed_tokens + k + 1, k) for i, s in enumerate(seqs)}
        row[f"draft_graph_k{k}_ms"] = _median_ms(lambda ds=ds: (ds.launch(batch_k, items, chain), ds.read(batch)), reps)
        del vs, ds
        hc = torch.zeros(batch * (k + 1), model.cfg.hc_mult, model.cfg.hidden_size, dtype=model.embed.weight.dtype,
                         device=eng.device)
        items = [(s, s.num_computed_tokens, [s.last_token_id] * (k + 1)) for s in seqs]
        row[f"mtp_rows{k + 1}_ms"] = _median_ms(
            lambda: spec.mtp.compute_logits(model, spec.mtp(model, spec._batch(items), spec.mtp_cache, hc)[
                torch.arange(k, batch * (k + 1), k + 1, device=eng.device)]).argmax(-1), reps)
        for s in seqs:
            s.spec_token_ids = []
    one = [(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
    h1 = torch.zeros(batch, model.cfg.hc_mult, model.cfg.hidden_size, dtype=model.embed.weight.dtype, device=eng.device)
    row["draft_ms"] = _median_ms(
        lambda: spec.mtp.compute_logits(model, spec.mtp(model, spec._batch(one), spec.mtp_cache, h1)).argmax(-1), reps)
    for r in ids:
        eng.abort(r)
    eng.spec = saved
    return row


def model_speedup(row: dict, graphs: bool = True) -> dict:
    """Speed-up over plain decoding by acceptance rate: a step costs the verify and the MTP's work,
    both graphed (the graphs' times) or both eager (the verify, catch-up and k - 1 draft steps)."""
    out = {}
    for k in (1, 2, 3):
        if graphs:
            cost = row[f"verify_k{k}_ms"] + row[f"draft_graph_k{k}_ms"]
        else:
            cost = row[f"verify_k{k}_eager_ms"] + row[f"mtp_rows{k + 1}_ms"] + (k - 1) * row["draft_ms"]
        for a in ALPHAS:
            tokens = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
            out[f"k{k}_a{a:g}"] = tokens * row["plain_ms"] / cost
    return out


ACCEPTANCE_LENGTHS = (2.0, 3.0, 4.4, 5.4)  # DSpark's published range: ~4.4 real prompts, ~5.4 random tokens


def _graph_ms(fn, reps: int) -> float:
    """fn captured as one CUDA graph (its own pool) and its replay timed; on the CPU fn itself."""
    if not torch.cuda.is_available():
        return _median_ms(fn, reps)
    graph, _ = capture(fn, torch.cuda.graph_pool_handle())
    return _median_ms(graph.replay, reps)


def micro_dspark(eng, spec, batch: int, input_len: int, reps: int) -> dict:
    """DSpark step times on live sequences (their caches are scribbled on; they are aborted after):
    the plain decode step (graph); the verify forward with the target features of k + 1 tokens per
    sequence, graph and eager; the rollback graph reopening a block per sequence and ratio; the
    drafter's step (every verify row's context keys, then every sequence's block) as the engine
    runs it after a verify graph (pack, one copy, the DSpark graph's replay, the read-back) and
    eagerly; one stage over one row per sequence as a graph (an MTP draft step's shape: the proxy
    for MTP on the same model)."""
    saved, eng.spec = eng.spec, None
    ids = _prefill(eng, batch, input_len, eng.max_model_len - input_len - 8, f"micro-{batch}", seed=batch)
    eng.flush()
    seqs = [eng.requests[r].seq for r in ids]
    model, runner, cache, prop = eng.model, eng.runner, eng.cache, spec.dspark
    d, own_k = model.cfg.dspark, spec.k
    for s in seqs:
        cache.allocate(s.blocks, eng.scheduler._window_lo(s), s.num_computed_tokens + 1)
    row = {"batch": batch, "plain_ms": _median_ms(lambda: runner.run([(s, 1) for s in seqs]), reps)}
    row.update(_plain_step_ms(spec, seqs, reps))
    for k in sorted({1, 2, 3, d.block_size, own_k}):
        for s in seqs:
            s.spec_token_ids = [s.last_token_id] * k
            cache.allocate(s.blocks, eng.scheduler._window_lo(s), s.num_computed_tokens + k + 1)
        batch_k = [(s, 1 + k) for s in seqs]

        def verify():
            fb = runner.build_batch(batch_k)
            hidden, features = model.dspark_features(fb, cache)
            return model.compute_logits(hidden[fb.logits_rows]), features

        row[f"verify_k{k}_eager_ms"] = _median_ms(verify, reps)
        # the verify graph of this batch bucket: the engine's own for its k, one captured here for the others
        # (on the CPU: the padded static batches, run eagerly)
        own = k == own_k and spec.verify_steps is not None and batch in spec.verify_steps.static
        pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        vs = spec.verify_steps if own else VerifyGraphs(model, cache, eng.max_model_len, k, [batch], pool, features=True)
        row[f"verify_k{k}_ms"] = _median_ms(lambda vs=vs: vs.run(batch_k), reps)
        if k == own_k:
            row.update(_drafter_step_ms(eng, spec, vs, seqs, k, own, pool, reps))
        del vs
        for s in seqs:
            s.spec_token_ids = []
    # one stage over one row per sequence, block 1, as a graph: the shape of a graphed MTP draft step
    drafter = prop.drafter
    t = lambda x: torch.tensor(x, device=eng.device)
    slots, starts, last = t([s.blocks.state_slot for s in seqs]), t([s.num_computed_tokens for s in seqs]), \
        t([s.last_token_id for s in seqs])
    full, block = drafter.stages, d.block_size
    try:
        drafter.stages, drafter.cfg = torch.nn.ModuleList(full[:1]), _with_block(drafter.cfg, 1)
        row["stage_row_ms"] = _graph_ms(lambda: drafter.draft_from_ring(model, prop.ring, slots, starts, last, 0.0),
                                        reps)
    finally:
        drafter.stages, drafter.cfg = full, _with_block(drafter.cfg, block)
    for r in ids:
        eng.abort(r)
    eng.spec = saved
    return row


def _drafter_step_ms(eng, spec, vs: VerifyGraphs, seqs, k: int, own: bool, pool, reps: int) -> dict:
    """After a verify of k + 1 rows per sequence, every draft accepted (the most keys to write):
    the rollback graph (one block reopened per sequence and ratio: its worst case), the drafter's
    graph as the decoder launches and reads it, and the same work eagerly."""
    prop, B, k1 = spec.dspark, len(seqs), k + 1
    fixes = {m: [(b, s.blocks.state_slot, b, -1) for b, s in enumerate(seqs)] for m in vs.ratios}
    out = {"rollback_ms": _median_ms(lambda: vs.rollback.run(B, fixes), reps)}
    rb = vs.rollback
    out["rollback_launches"] = _device_ops(lambda: rb._forward(rb.static[vs.bucket(B)]))  # what its graph holds
    ds = spec.draft_steps if own and spec.draft_steps is not None else DSparkGraphs(prop, eng.model, vs, pool)
    items = [(s, s.num_computed_tokens, [s.last_token_id] * k1) for s in seqs]
    where = [(b, b * k1) for b in range(B)]
    drafting = [(j, s.num_computed_tokens + k1, k, 0) for j, s in enumerate(seqs)]
    # the host's record of each window before the block (the ring's contents do not matter for timing)
    first = [max(0, s.num_computed_tokens + k1 - prop.window) for s in seqs]
    prop.new_rows([(s, f, [0] * (s.num_computed_tokens + k1 - f)) for s, f in zip(seqs, first)])
    assert len(prop.ready(items, drafting)) == B, "every sequence drafts"
    out["draft_ms"] = _median_ms(lambda: ds.launch([(s, k1) for s in seqs], items, where, drafting)(), reps)
    features = vs.features[:B * k1]
    out["draft_eager_ms"] = _median_ms(lambda: (prop.absorb(items, features), prop.draft(items, drafting)), reps)
    return out


def _device_ops(fn) -> int | None:
    """The kernels and copies fn puts on the GPU, counted by the profiler (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _plain_step_ms(spec, seqs, reps: int) -> dict:
    """A step that verifies nothing as served: the plain decode graph with the target features, then
    DSpark's drafter graph after it with every block drafted, or the keys only (every sequence backed off)."""
    B = len(seqs)
    if spec.plain_steps is None or B not in spec.plain_steps.static:
        return {}
    batch = [(s, 1) for s in seqs]
    items = [(s, s.num_computed_tokens, [s.last_token_id]) for s in seqs]
    where = [(b, b) for b in range(B)]
    drafting = [(j, s.num_computed_tokens + 1, spec.k, 0) for j, s in enumerate(seqs)]
    ds, prop = spec.plain_draft_steps, spec.dspark
    # the host's record of each window before the block (the ring's contents do not matter for timing)
    first = [max(0, s.num_computed_tokens + 1 - prop.window) for s in seqs]
    prop.new_rows([(s, f, [0] * (s.num_computed_tokens + 1 - f)) for s, f in zip(seqs, first)])
    assert len(prop.ready(items, drafting)) == B, "every sequence drafts"
    return {"plain_features_ms": _median_ms(lambda: spec.plain_steps.run(batch), reps),
            "plain_draft_ms": _median_ms(lambda: ds.launch(batch, items, where, drafting)(), reps),
            "plain_keys_ms": _median_ms(lambda: ds.launch(batch, items, where, [])(), reps)}


def _with_block(cfg, block_size: int):
    return dataclasses.replace(cfg, dspark=dataclasses.replace(cfg.dspark, block_size=block_size))


def model_dspark(row: dict, k: int) -> dict:
    """Modelled speed-up over plain decoding at mean acceptance length L (tokens per verify step),
    from the graphs' times: DSpark verifying k drafts of its block (L <= k + 1) costs the verify of
    k + 1 tokens and the drafter's step; with k = 3 (a shorter verify) L <= 4; MTP with k drafts
    costs the verify of k + 1 tokens and k chained draft steps (each timed as one stage over one
    row), L <= k + 1. The rollback (row["rollback_ms"], only when a rejected draft closed a block)
    is left out of all of them."""
    plain, out = row["plain_ms"], {}
    for L in ACCEPTANCE_LENGTHS:
        out[f"dspark_k{k}_L{L:g}"] = min(L, k + 1) * plain / (row[f"verify_k{k}_ms"] + row["draft_ms"])
        out[f"dspark_k3_L{L:g}"] = min(L, 4) * plain / (row["verify_k3_ms"] + row["draft_ms"])
        for m in (1, 3):
            out[f"mtp_k{m}_L{L:g}"] = min(L, m + 1) * plain / (row[f"verify_k{m}_ms"] + m * row["stage_row_ms"])
    return out


def end_to_end(eng, spec, batch: int, input_len: int, output_len: int, own: str = "mtp") -> dict:
    """Decode tokens/s after the prefills: plain, speculative with the drafter's own drafts, and with
    drafts forced to that run's outputs. The forced run replays what the speculative path itself
    produced (its verify forwards, in the same batch shapes), not the plain run's tokens: plain
    decode steps take other kernel paths (decode graphs, one row per sequence), and on random
    weights argmax near-ties would flip and part the replay from its source. own: the key of the
    run with the drafter's own drafts ("mtp", "dspark"). DSpark also runs its own drafts with the
    acceptance gate off ("dspark_ungated": every step verifies, the raw overhead; its outputs are
    what the forced run replays), the served runs with the gate on; steps_without_verify counts the
    speculative steps in which no sequence verified."""
    res, outputs = {"batch": batch}, {}
    gate = spec.gate.min_length if spec.gate is not None else None
    source = f"{own}_ungated" if gate is not None else own
    modes = ("plain", source, own, "forced") if gate is not None else ("plain", own, "forced")
    for mode in modes:
        eng.spec = None if mode == "plain" else spec
        spec.force_drafts(outputs[source] if mode == "forced" else None)
        if gate is not None:
            spec.gate.min_length = 0 if mode == source else gate
        before, paths = dict(spec.counters), dict(spec.step_paths)
        backoffs = spec.gate.backoffs if gate is not None else 0
        ids = _prefill(eng, batch, input_len, output_len, f"e2e-{batch}", seed=1000 + batch)
        seqs = {r: eng.requests[r].seq for r in ids}
        done = {r: len(s.output_token_ids) for r, s in seqs.items()}
        sync()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        sync()
        dt = time.perf_counter() - t
        tokens = sum(len(s.output_token_ids) - done[r] for r, s in seqs.items())
        res[f"{mode}_tok_s"] = tokens / dt
        outputs[mode] = {r: list(s.output_token_ids) for r, s in seqs.items()}
        if mode != "plain":
            drafted = spec.counters["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            acc = spec.counters["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            res[f"{mode}_acceptance"] = acc / drafted if drafted else 0.0
            res[f"{mode}_same_as_plain"] = sum(outputs[mode][r] == outputs["plain"][r] for r in ids)
            res[f"{mode}_step_paths"] = {k: v - paths[k] for k, v in spec.step_paths.items()}
            res[f"{mode}_steps_without_verify"] = (spec.counters["spec_decode_num_steps_without_verify"]
                                                   - before["spec_decode_num_steps_without_verify"])
            if gate is not None:
                res[f"{mode}_backoffs"] = spec.gate.backoffs - backoffs
    res[f"forced_same_as_{source}"] = sum(outputs["forced"][r] == outputs[source][r] for r in outputs[source])
    spec.force_drafts(None)
    eng.spec = spec
    res["forced_speedup"] = res["forced_tok_s"] / res["plain_tok_s"]
    for mode in {own, source}:
        res[f"{mode}_overhead"] = 1 - res[f"{mode}_tok_s"] / res["plain_tok_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--quant", default="bf16", choices=QUANTS)
    ap.add_argument("--cache-dir", default="/tmp/ckpt")
    ap.add_argument("--batches", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--json", default=None)
    ap.add_argument("--method", default="mtp", choices=("mtp", "dspark"),
                    help="dspark: a 0731 checkpoint's DSpark stages (--model a --layout 0731 checkpoint)")
    args = ap.parse_args()
    model = resolve_model(SimpleNamespace(model=args.model, preset=args.preset, quant=args.quant,
                                          cache_dir=args.cache_dir))
    # MTP k = 3; DSpark as served: k = the checkpoint's whole block
    spec = {"method": "mtp", "num_speculative_tokens": 3} if args.method == "mtp" else {"method": "dspark"}
    engine_args = {"max_num_seqs": max(args.batches), "max_model_len": 4096, **json.loads(args.engine_args),
                   "speculative_config": spec}
    if args.method == "dspark":
        return main_dspark(args, model, engine_args)
    t = time.perf_counter()
    eng = LLM(model, **engine_args).engine
    print(f"engine up in {time.perf_counter() - t:.0f} s (graphs: {sorted(eng.runner.graphs)})", flush=True)
    spec = eng.spec
    print(f"verify graphs: {sorted(spec.verify_steps.static) if spec.verify_steps else 'none (eager)'}", flush=True)
    rows, e2e = [], []

    def dump():  # after every row: a run cut short by its timeout keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": model, "engine_args": engine_args, "input_len": args.input_len,
                           "output_len": args.output_len, "verify_graphs": sorted(spec.verify_steps.static)
                           if spec.verify_steps else [], "micro": rows, "end_to_end": e2e}, f, indent=2)

    print("step times (ms): plain decode (graph); verify of k+1 tokens per sequence, graph / eager; the MTP's "
          "graph for k drafts (catch-up over k+1 rows, k-1 chained); eager: the MTP over k+1 rows, one chained draft")
    print(f"{'batch':>5} {'plain':>7} {'verify k=1':>13} {'k=2':>13} {'k=3':>13} {'draft graph k=1/2/3':>20} "
          f"{'mtp 2':>6} {'mtp 3':>6} {'mtp 4':>6} {'draft':>6}")
    for b in args.batches:
        r = micro(eng, spec, b, args.input_len, args.reps)
        r["speedup"] = model_speedup(r)
        r["speedup_eager"] = model_speedup(r, graphs=False)
        rows.append(r)
        ver = " ".join(f"{r[f'verify_k{k}_ms']:>6.2f}/{r[f'verify_k{k}_eager_ms']:<6.1f}" for k in (1, 2, 3))
        dg = "/".join(f"{r[f'draft_graph_k{k}_ms']:.2f}" for k in (1, 2, 3))
        print(f"{b:>5} {r['plain_ms']:>7.2f} {ver} {dg:>20} {r['mtp_rows2_ms']:>6.2f} {r['mtp_rows3_ms']:>6.2f} "
              f"{r['mtp_rows4_ms']:>6.2f} {r['draft_ms']:>6.2f}", flush=True)
        dump()
    print("\nmodelled speed-up over plain decoding (verify and MTP graphed), by per-token acceptance rate a")
    print(f"{'batch':>5} {'k':>2} " + " ".join(f"{'a=' + format(a, 'g'):>6}" for a in ALPHAS))
    for r in rows:
        for k in (1, 2, 3):
            print(f"{r['batch']:>5} {k:>2} " + " ".join(f"{r['speedup'][f'k{k}_a{a:g}']:>6.2f}" for a in ALPHAS))
    print("\nend to end, k=3, decode tok/s after the prefills; forced = drafts replayed from the mtp run's outputs;"
          "\nacc = acceptance, =plain = greedy streams equal to plain decoding's, graph = verify steps replayed as graphs")
    print(f"{'batch':>5} {'plain':>8} {'mtp':>8} {'acc':>5} {'=plain':>6} {'forced':>8} {'acc':>5} {'=mtp':>5} "
          f"{'graph':>9} {'speed-up':>8} {'overhead':>8}")
    for b in args.batches:
        r = end_to_end(eng, spec, b, args.input_len, args.output_len)
        e2e.append(r)
        p = r["forced_step_paths"]  # verify steps replayed as graphs / all
        print(f"{b:>5} {r['plain_tok_s']:>8.1f} {r['mtp_tok_s']:>8.1f} {r['mtp_acceptance']:>5.2f} "
              f"{r['mtp_same_as_plain']:>6} {r['forced_tok_s']:>8.1f} {r['forced_acceptance']:>5.2f} "
              f"{r['forced_same_as_mtp']:>5} {p['verify_graph']:>4}/{p['verify_graph'] + p['verify_eager']:<4} {r['forced_speedup']:>8.2f} "
              f"{100 * r['mtp_overhead']:>7.1f}%", flush=True)
        dump()


def main_dspark(args, model: str, engine_args: dict) -> None:
    t = time.perf_counter()
    eng = LLM(model, **engine_args).engine
    spec, block = eng.spec, eng.cfg.dspark.block_size
    graphs = sorted(spec.verify_steps.static) if spec.verify_steps else []
    print(f"engine up in {time.perf_counter() - t:.0f} s (graphs: {sorted(eng.runner.graphs)}); DSpark: block {block}, "
          f"k {spec.k}, verify and drafter graphs: {graphs or 'none (eager)'}", flush=True)
    rows, e2e = [], []

    def dump():  # after every row: a run cut short by its timeout keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": model, "engine_args": engine_args, "method": "dspark", "k": spec.k,
                           "input_len": args.input_len, "output_len": args.output_len, "graphs": graphs,
                           "micro": rows, "end_to_end": e2e}, f, indent=2)

    ks = sorted({1, 2, 3, block, spec.k})
    print("step times (ms): plain decode (graph); verify of k+1 tokens per sequence with the target features, "
          f"graph / eager; after a verify of k={spec.k}: the rollback graph (a block reopened per sequence and ratio), "
          "the drafter's step (keys of the verify rows + a block per sequence) graph / eager; one stage over one row, "
          "graph (MTP step proxy)")
    print(f"{'batch':>5} {'plain':>7} " + " ".join(f"{'k=' + str(k):>13}" for k in ks)
          + f" {'rollback':>8} {'launches':>8} {'draft':>13} {'stage':>7} {'plain+f':>7} {'+draft':>7} {'+keys':>7}")
    for b in args.batches:
        r = micro_dspark(eng, spec, b, args.input_len, args.reps)
        r["speedup"] = model_dspark(r, spec.k)
        rows.append(r)
        ver = " ".join(f"{r[f'verify_k{k}_ms']:>6.2f}/{r[f'verify_k{k}_eager_ms']:<6.1f}" for k in ks)
        print(f"{b:>5} {r['plain_ms']:>7.2f} {ver} {r['rollback_ms']:>8.2f} {str(r['rollback_launches']):>8} "
              f"{r['draft_ms']:>6.2f}/{r['draft_eager_ms']:<6.1f} {r['stage_row_ms']:>7.2f} "
              + " ".join(f"{r[c]:>7.2f}" if c in r else f"{'-':>7}" for c in ("plain_features_ms", "plain_draft_ms",
                                                                             "plain_keys_ms")), flush=True)
        dump()
    print("\nmodelled speed-up over plain decoding by mean acceptance length L (tokens per verify step), graphs' times")
    cols = (f"dspark_k{spec.k}", "dspark_k3", "mtp_k1", "mtp_k3")
    print(f"{'batch':>5} {'L':>4} " + " ".join(f"{c:>10}" for c in cols))
    for r in rows:
        for L in ACCEPTANCE_LENGTHS:
            print(f"{r['batch']:>5} {L:>4g} " + " ".join(f"{r['speedup'][f'{c}_L{L:g}']:>10.2f}" for c in cols))
    print(f"\nend to end, k={spec.k}, decode tok/s after the prefills; own = DSpark's drafts (random weights: acceptance ~0) "
          "with the acceptance gate off (raw: every step verifies and rolls back) and on (gated: as served); forced = "
          "drafts replayed from the raw run's outputs, gate on; plain steps = speculative steps that verified nothing; "
          "graph = the gated run's verify graphs / plain-step graphs / all steps; async = of its plain steps, those left "
          "in flight (async scheduling: every sequence held back by the gate)")
    print(f"{'batch':>5} {'plain':>8} {'raw':>8} {'overhead':>8} {'gated':>8} {'overhead':>8} {'plain st':>8} "
          f"{'backoffs':>8} {'forced':>8} {'acc':>5} {'speed-up':>8} {'=plain':>6} {'graph':>14} {'async':>5}")
    for b in args.batches:
        r = end_to_end(eng, spec, b, args.input_len, args.output_len, own="dspark")
        p = r["dspark_step_paths"]
        e2e.append(r)
        print(f"{b:>5} {r['plain_tok_s']:>8.1f} {r['dspark_ungated_tok_s']:>8.1f} {100 * r['dspark_ungated_overhead']:>7.1f}% "
              f"{r['dspark_tok_s']:>8.1f} {100 * r['dspark_overhead']:>7.1f}% {r['dspark_steps_without_verify']:>8} "
              f"{r['dspark_backoffs']:>8} {r['forced_tok_s']:>8.1f} {r['forced_acceptance']:>5.2f} "
              f"{r['forced_speedup']:>8.2f} {r['dspark_same_as_plain']:>6} "
              f"{p['verify_graph']:>4}/{p['plain_graph']:<4}/{p['verify_graph'] + p['plain_graph'] + p['verify_eager']:<4} "
              f"{p['plain_async']:>5}", flush=True)
        dump()


if __name__ == "__main__":
    main()
