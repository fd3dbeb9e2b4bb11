"""How many device ops a DeepSeek-V4.1 decode step issues, by the engine function that issues them
(CPU, no GPU needed): the launch budget a decode CUDA graph replays.

    python -m tools.count_decode_ops [--model DIR | --preset v41-tiny] [--dtype bfloat16] [--json OUT]

Every aten op of one model forward on the decode path's static batch of 1 (what a graph captures)
is counted, views excluded (they launch nothing), and charged to the innermost engine/ or kernels/
function on the stack. An op of the kernels API that is a fused Triton kernel on CUDA
(kernels/fused.py) counts as one launch, whatever its torch reference does on the CPU: the counts
are what the GPU would run. Per layer kind too (window only, ratio r source / reader, index
source, Engram), so a 40-layer model's budget follows from the tiny one's.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import fused

ROOTS = ("/engine/", "/kernels/")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_source: collections.Counter = collections.Counter()
        self.by_layer: collections.Counter = collections.Counter()
        self.layer = "head"
        self.muted = 0  # inside a fused op's torch reference

    def charge(self, source: str) -> None:
        self.by_source[source] += 1
        self.by_layer[self.layer] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.muted or func.is_view or func in (torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default):
            return out
        f = sys._getframe(1)
        while f is not None and not any(r in f.f_code.co_filename for r in ROOTS):
            f = f.f_back
        src = "?" if f is None else f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_name}"
        self.charge(src)
        return out


def _fused_as_one(counter: _Count) -> None:
    """Each op kernels.fused binds on CUDA: one launch (its reference runs muted)."""
    for name in fused.FUSED:
        ref = getattr(kernels, name)

        def op(*a, _ref=ref, _name=name, **k):
            counter.charge(f"kernels.{_name} (fused)")
            counter.muted += 1
            try:
                return _ref(*a, **k)
            finally:
                counter.muted -= 1
        setattr(kernels, name, op)


def _moe_as_fused(counter: _Count):
    """The CPU's per-expert loop (ops.routed_experts) stands for CUDA's kernels.moe_experts: one launch."""
    from engine import v41_ops

    ref = v41_ops.routed_experts

    def op(*a, **k):
        counter.charge("kernels.moe_experts (fused)")
        counter.muted += 1
        try:
            return ref(*a, **k)
        finally:
            counter.muted -= 1
    v41_ops.routed_experts = op
    return ref


def layer_kind(cfg, i: int) -> str:
    r = cfg.compress_ratios[i]
    kind = "window" if not r else (f"r{r} source" if i in cfg.kv_source_layer_ids else f"r{r} reader")
    if i in cfg.index_source_layer_ids:
        kind += " +index"
    if i == cfg.candidate_source_layer_id:
        kind += " +candidates"
    if i in cfg.engram_layer_ids:
        kind += " +engram"
    return kind


def count(model_dir: str, dtype: torch.dtype, prompt_len: int = 40) -> dict:
    from engine.cache_v41 import V41KVCache
    from engine.loader_v41 import load_v41_model
    from engine.request import SamplingParams
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    torch.set_num_threads(1)
    model = load_v41_model(model_dir, dtype, decoder_replay=False)
    cfg = model.cfg
    cache = V41KVCache(cfg, 16, 64, 64, 2, dtype)
    runner = ModelRunner(model, cache, max_model_len=512)
    runner.static_decode_batches([1])
    seq = Sequence("t", [5 + (7 * j) % 200 for j in range(prompt_len)], SamplingParams())
    cache.allocate(seq.blocks, 0, prompt_len)
    out = runner.run([(seq, prompt_len)])
    seq.num_computed_tokens = seq.compress_from = prompt_len
    seq.output_token_ids.append(int(out[-1].argmax()))
    cache.allocate(seq.blocks, prompt_len - cfg.sliding_window + 1, prompt_len + 1)

    counter = _Count()
    saved = {name: getattr(kernels, name) for name in fused.FUSED}
    hooks = [b.register_forward_pre_hook(lambda m, a: setattr(counter, "layer", m.layer)) for b in model.layers]
    hooks.append(model.register_forward_pre_hook(lambda m, a: setattr(counter, "layer", "embed")))
    forward = model.forward
    from engine import v41_ops
    moe = v41_ops.routed_experts
    try:
        _fused_as_one(counter)
        _moe_as_fused(counter)

        def counted(*a, **k):
            with counter:
                return forward(*a, **k)
        model.forward = counted
        runner.run([(seq, 1)])
    finally:
        model.forward = forward
        v41_ops.routed_experts = moe
        for h in hooks:
            h.remove()
        for name, fn in saved.items():
            setattr(kernels, name, fn)
    per_layer = {i: counter.by_layer[i] for i in range(cfg.num_layers)}
    kinds: dict = {}
    for i, n in per_layer.items():
        kinds.setdefault(layer_kind(cfg, i), []).append(n)
    return {"total": sum(counter.by_source.values()), "by_source": dict(counter.by_source.most_common()),
            "per_layer": per_layer, "by_kind": {k: sorted(set(v)) for k, v in kinds.items()},
            "outside_layers": counter.by_layer["embed"] + counter.by_layer["head"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a V4.1 checkpoint (default: a fresh random --preset one)")
    ap.add_argument("--preset", default="v41-tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from engine.random_checkpoint_v41 import write_v41_checkpoint
            model = str(write_v41_checkpoint(Path(tmp) / a.preset, a.preset))
        res = count(model, getattr(torch, a.dtype))
    print(f"ops per decode step (batch 1, {a.dtype}, backend {kernels.backend()!r}, fused ops as one launch): "
          f"{res['total']}")
    print(f"{'source':<52} {'ops':>6}")
    for src, n in list(res["by_source"].items())[:a.rows]:
        print(f"{src:<52} {n:>6}")
    print(f"{'layer kind':<52} ops per layer")
    for kind, ns in res["by_kind"].items():
        print(f"{kind:<52} {ns}")
    print(f"{'embed + head (outside the layers)':<52} {res['outside_layers']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
