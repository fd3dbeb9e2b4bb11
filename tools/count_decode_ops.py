"""How many device kernels a DeepSeek-V4.1 (or V4) decode step launches, by the engine function that
launches them (CPU, no GPU needed): the budget a decode CUDA graph replays.

    python -m tools.count_decode_ops [--model DIR | --preset v41-tiny] [--dtype bfloat16] [--by-kind] [--json OUT]
    python -m tools.count_decode_ops --preset tiny --quant fp8-fp4 --override '{"hidden_size": 256, ...}'
    python -m tools.count_decode_ops --preset tiny --quant fp8-fp4 --fuse all   (the launch-saving fusions on)
    python -m tools.count_decode_ops --preset tiny --tp-share 2   (rank 0's share with expert parallelism, bf16)
    python -m tools.count_decode_ops --preset tiny --quant fp8-fp4 --batch 40   (the paths a bigger batch takes)

One model forward on the decode path's static batch (1, or --batch; what a graph captures) runs with every op
the CUDA dispatch (kernels/fused.py) binds to a Triton kernel running that kernel (under Triton's
interpreter), and the routed experts through the fused MoE as on CUDA. Counted: every aten op that
launches work (views and allocations excluded), charged to the innermost engine/ or kernels/
function on the stack, and every Triton launch, charged to its kernels API op. Per layer kind too
(window only, ratio r source / reader, index source, Engram), so a 40-layer model's budget follows
from the tiny one's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kernels  # noqa: E402
from kernels import fused  # noqa: E402

ROOTS = ("/engine/", "/kernels/")
NO_LAUNCH = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.empty.memory_format,
             torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default}


def _launches(func, args, out) -> bool:
    """Whether an aten op runs a kernel: views do not, nor ops returning no tensor (dtype queries);
    `.to(dtype)` is an aliasing op that copies unless the dtype already matches."""
    if not isinstance(out, torch.Tensor) and not (isinstance(out, (tuple, list)) and out
                                                   and isinstance(out[0], torch.Tensor)):
        return func is torch.ops.aten._local_scalar_dense.default  # a host sync: shown, never hidden
    if func._schema.name == "aten::to":
        return out.data_ptr() != args[0].data_ptr()
    return not func.is_view


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_source: collections.Counter = collections.Counter()
        self.by_layer: collections.Counter = collections.Counter()
        self.by_layer_source: collections.Counter = collections.Counter()
        self.layer = "head"
        self.muted = 0  # inside a Triton launch (the interpreter's own torch calls)
        self.label = None  # inside a fused op: its name

    def charge(self, source: str) -> None:
        self.by_source[source] += 1
        self.by_layer[self.layer] += 1
        self.by_layer_source[self.layer, source] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.muted or func in NO_LAUNCH or not _launches(func, args, out):
            return out
        if self.label is not None:
            self.charge(self.label)
            return out
        f = sys._getframe(1)
        while f is not None and not any(r in f.f_code.co_filename for r in ROOTS):
            f = f.f_back
        src = "?" if f is None else f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_name}"
        self.charge(src)
        return out


def _run_fused(counter: _Count, name: str, fn):
    def op(*a, **k):
        outer, counter.label = counter.label, f"kernels.{name} (fused)"
        try:
            return fn(*a, **k)
        finally:
            counter.label = outer
    return op


def _count_launches(counter: _Count):
    """Every Triton launch (interpreted): one kernel, charged to the fused op around it."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *a, **k):
        counter.charge(counter.label or f"triton.{self.fn.__name__}")
        counter.muted += 1
        try:
            return run(self, *a, **k)
        finally:
            counter.muted -= 1
    InterpretedFunction.run = counted
    return run


def _moe_as_on_cuda(model) -> list:
    """The CPU MoE's per-expert loop (ops.routed_experts) replaced by CUDA's fused MoE call."""
    from engine.models.deepseek_v41 import ops as v41_ops

    def routed(x, w1, w3, w2, weights, indices, limit):
        return kernels.moe_experts(x, w1, w3, w2, weights.to(x.dtype), indices, limit, None)
    saved = v41_ops.routed_experts
    v41_ops.routed_experts = routed
    return [saved]


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


def layer_kind_v4(cfg, i: int) -> str:
    r = cfg.compress_ratios[i]
    return ("window" if not r else f"r{r}") + (" +hash" if i < cfg.num_hash_layers else "")


def _pool(batch: int) -> tuple[int, int, int, int]:
    """The cache's block size, window and full blocks and sequences for a decode batch of `batch` 40-token prompts."""
    return 16, 8 * batch + 56, 8 * batch + 56, batch + 1


def _v4(model_dir: str, dtype: torch.dtype, batch: int = 1):
    """A DeepSeek-V4 checkpoint in its stored formats (as CUDA keeps them), its cache, its layer kinds."""
    import json as _json

    from engine.cache import KVCache
    from engine.models.deepseek_v4.loader import load_model

    quantized = bool(_json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config"))
    model = load_model(model_dir, dtype, quantized=quantized)
    return model, KVCache(model.cfg, *_pool(batch), dtype), layer_kind_v4


def _on_layer(model, counter) -> list:
    """Charge each layer's launches to it: V4.1's layers run through forward (a pre-hook), V4's blocks
    through run (wrapped for the count; the returned function undoes it)."""
    if hasattr(model.layers[0], "run"):
        def wrap(i, block):
            run = block.run

            def counted(*a, **k):
                counter.layer = i
                try:
                    return run(*a, **k)
                finally:
                    counter.layer = "head"
            block.run = counted
        for i, block in enumerate(model.layers):
            wrap(i, block)
        return [lambda: [b.__dict__.pop("run") for b in model.layers]]
    hooks = [b.register_forward_pre_hook(lambda m, a: setattr(counter, "layer", m.layer)) for b in model.layers]
    return [h.remove for h in hooks]


def count(model_dir: str, dtype: torch.dtype, prompt_len: int = 40, batch: int = 1) -> dict:
    from engine.models import registry

    if registry.family(model_dir).Model.supports_decoder_trim:  # DeepSeek-V4.1: its own cache and layer kinds
        model = registry.load_model(model_dir, dtype, decoder_trim=False)
        return count_model(model, model.cache_class(model.cfg, *_pool(batch), dtype), layer_kind, prompt_len, batch)
    return count_model(*_v4(model_dir, dtype, batch), prompt_len, batch)


def tp_share(preset: str, override: dict, world: int, dtype: torch.dtype, batch: int = 1):
    """Rank 0's share of a V4 preset at tensor_parallel_size `world` with expert parallelism (tools.bench_tp_share's,
    collectives skipped, bf16 weights on the CPU), its cache and layer kinds: count_model's arguments."""
    from engine.cache import KVCache
    from engine.models.deepseek_v4.config import parse_config
    from engine.models.deepseek_v4.random_checkpoint import build_config
    from engine.parallel import TensorParallel, check_parallel
    from tools.bench_tp_share import random_share

    cfg = parse_config(build_config(preset, override, "bf16"))
    check_parallel(cfg, world, True)
    model = random_share(cfg, TensorParallel(0, world, expert_parallel=True, share_only=True), "cpu", dtype)
    return model, KVCache(model.cfg, *_pool(batch), dtype), layer_kind_v4


def count_model(model, cache, kind_of, prompt_len: int = 40, batch: int = 1) -> dict:
    """The launches of one decode step of `batch` sequences (prompts of prompt_len tokens, prefilled first)."""
    from engine.request import SamplingParams
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    torch.set_num_threads(1)
    cfg = model.cfg
    runner = ModelRunner(model, cache, max_model_len=512)
    runner.static_decode_batches([batch])
    seqs = [Sequence(f"t{i}", [5 + (7 * j + i) % 200 for j in range(prompt_len)], SamplingParams())
            for i in range(batch)]
    for seq in seqs:
        cache.allocate(seq.blocks, 0, prompt_len)
    out = runner.run([(seq, prompt_len) for seq in seqs])
    for i, seq in enumerate(seqs):
        seq.num_computed_tokens = seq.compress_from = prompt_len
        seq.output_token_ids.append(int(out[i].argmax()))  # one logits row a sequence: its last
        cache.allocate(seq.blocks, prompt_len - cfg.sliding_window + 1, prompt_len + 1)

    counter = _Count()
    saved = {name: getattr(kernels, name) for name in fused.FUSED}
    undo = _on_layer(model, counter)
    undo.append(model.register_forward_pre_hook(lambda m, a: setattr(counter, "layer", "embed")).remove)
    forward = model.forward
    from triton.runtime.interpreter import InterpretedFunction

    from engine.models.deepseek_v41 import ops as v41_ops

    run = _count_launches(counter)
    (moe,) = _moe_as_on_cuda(model)
    try:
        for name, fn in fused.FUSED.items():
            setattr(kernels, name, _run_fused(counter, name, fn))

        def counted(*a, **k):
            with counter:
                return forward(*a, **k)
        model.forward = counted
        runner.run([(seq, 1) for seq in seqs])
    finally:
        model.forward = forward
        v41_ops.routed_experts = moe
        InterpretedFunction.run = run
        for u in undo:
            u()
        for name, fn in saved.items():
            setattr(kernels, name, fn)
    per_layer = {i: counter.by_layer[i] for i in range(cfg.num_layers)}
    kinds: dict = {}
    first_of_kind: dict = {}
    for i, n in per_layer.items():
        kinds.setdefault(kind_of(cfg, i), []).append(n)
        first_of_kind.setdefault(kind_of(cfg, i), i)
    kind_sources = {kind: dict(sorted(((src, n) for (layer, src), n in counter.by_layer_source.items() if layer == i),
                                      key=lambda kv: -kv[1]))
                    for kind, i in first_of_kind.items()}
    return {"total": sum(counter.by_source.values()), "by_source": dict(counter.by_source.most_common()),
            "per_layer": per_layer, "by_kind": {k: sorted(set(v)) for k, v in kinds.items()},
            "by_kind_source": kind_sources,
            "outside_layers": counter.by_layer["embed"] + counter.by_layer["head"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a V4.1 or V4 checkpoint (default: a fresh random --preset one)")
    ap.add_argument("--preset", default="v41-tiny", help="v41-* (engine/models/deepseek_v41/random_checkpoint.py) or a V4 one")
    ap.add_argument("--quant", default="bf16", help="V4 presets: the weights as stored (random_checkpoint.QUANTS)")
    ap.add_argument("--override", default="{}", help="V4 presets: JSON over the preset's config")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--by-kind", action="store_true", help="each layer kind's ops by source (its first layer)")
    ap.add_argument("--fuse", default=None, help="kernels/fusions.py's switches for the count (a comma list, all, "
                                                  "none; default: DSV4_FUSE's)")
    ap.add_argument("--batch", type=int, default=1, help="sequences in the decode step (paths some batches take)")
    ap.add_argument("--tp-share", type=int, default=0, help="V4 presets: rank 0's share at this tensor_parallel_size "
                                                            "with expert parallelism (collectives skipped)")
    a = ap.parse_args()
    if a.fuse is not None:
        from kernels import fusions
        fusions.set_fusions("" if a.fuse == "none" else a.fuse)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if a.tp_share:
            res = count_model(*tp_share(a.preset, json.loads(a.override), a.tp_share, getattr(torch, a.dtype), a.batch),
                              batch=a.batch)
        elif model is None and a.preset.startswith("v41"):
            from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
            model = str(write_v41_checkpoint(Path(tmp) / a.preset, a.preset))
        elif model is None:
            from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
            model = str(write_checkpoint(Path(tmp) / a.preset, a.preset, override=json.loads(a.override), quant=a.quant))
        if not a.tp_share:
            res = count(model, getattr(torch, a.dtype), batch=a.batch)
    from kernels import fusions
    print(f"kernels per decode step (batch {a.batch}, {a.dtype}, the CUDA dispatch, fusions: "
          f"{','.join(fusions.enabled()) or 'none'}): {res['total']}")
    print(f"{'source':<52} {'kernels':>7}")
    for src, n in list(res["by_source"].items())[:a.rows]:
        print(f"{src:<52} {n:>6}")
    print(f"{'layer kind':<52} kernels per layer")
    for kind, ns in res["by_kind"].items():
        print(f"{kind:<52} {ns}")
    print(f"{'embed + head (outside the layers)':<52} {res['outside_layers']}")
    if a.by_kind:
        for kind, srcs in res["by_kind_source"].items():
            print(f"{kind}: " + ", ".join(f"{s} {n}" for s, n in srcs.items()))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
