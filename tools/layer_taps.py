"""Per-layer taps for the teacher-forced check (tools/check_teacher_forced.py): the residual
streams after the embedding and after every block, as float32 on the host, of the last row of
each eager forward (the row that predicts the next token when one sequence runs alone).

They see eager steps only: a CUDA graph replays kernels, not Python, so the check runs its
per-layer probes with the runner's graphs set aside (`eager_steps`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.models.deepseek_v4.model import DeepseekV4
from kernels import reference
from kernels.deepseek_v41 import reference as v41_reference

EMBED = -1  # the key of the embedding's output in LayerTaps.rows


def _routed_v4(moe, x: torch.Tensor, input_ids: torch.Tensor) -> list[int]:
    c, gate = moe.cfg, moe.gate
    hashed = gate.tid2eid[input_ids[-1:]] if gate.tid2eid is not None else None
    _, idx = reference.router_topk(x[-1:].float(), gate.weight.float(), gate.bias, c.num_experts_per_tok,
                                   c.routed_scaling_factor, c.scoring_func, hashed)
    return sorted(idx[0].tolist())


def _routed_v41(moe, x: torch.Tensor) -> list[int]:
    c, gate = moe.cfg, moe.gate
    _, idx = v41_reference.router(x[-1:], gate.weight, gate.bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                  c.scoring_func, c.gate_temp, c.norm_topk_prob)
    return sorted(idx[0].tolist())


class LayerTaps:
    """rows: layer index (EMBED for the embedding) -> that layer's streams [hc_mult, hidden] (the
    embedding: [hidden]) of the last row of the latest forward. routes: layer -> the routed experts
    the torch reference router picks on that row's MoE input (a flip there moves a layer's output by
    a whole expert: a jump that rounding alone can cause)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: dict[int, torch.Tensor] = {}
        self.routes: dict[int, list[int]] = {}
        self._undo: list = []

    def _keep(self, layer: int, streams: torch.Tensor) -> None:
        self.rows[layer] = streams[-1].float().cpu()

    def __enter__(self) -> LayerTaps:
        m = self.model
        self._undo.append(m.embed.register_forward_hook(lambda mod, args, out: self._keep(EMBED, out)).remove)
        routed = _routed_v4 if isinstance(m, DeepseekV4) else _routed_v41
        for i, block in enumerate(m.layers):
            hook = block.ffn.register_forward_pre_hook(
                lambda mod, args, _i=i: self.routes.__setitem__(_i, routed(mod, *args)))
            self._undo.append(hook.remove)
            if isinstance(m, DeepseekV4):
                # V4's blocks hand their last hc_post to the next block (fused there): apply it here
                # with the reference, on the last row only, so the tap adds nothing to the streams
                def run(*args, _run=block.run, _i=i, **kwargs):
                    h, (out, post, comb) = _run(*args, **kwargs)
                    self._keep(_i, reference.hc_post(h[-1:].float(), out[-1:].float(), post[-1:], comb[-1:]))
                    return h, (out, post, comb)

                block.run = run  # an instance attribute over the class's method, removed on exit
                self._undo.append(lambda b=block: delattr(b, "run"))
            else:  # V4.1: a block's forward returns (streams, the next site's pre)
                hook = block.register_forward_hook(lambda mod, args, out, _i=i: self._keep(_i, out[0]))
                self._undo.append(hook.remove)
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


@contextmanager
def eager_steps(runner):
    """The runner's decode and mixed-step graphs (or the CPU's static decode batches) set aside:
    every step runs eagerly on exactly its scheduled rows, so hooks see it."""
    graphs, mixed = runner.graphs, runner.mixed
    runner.graphs, runner.mixed = {}, None
    try:
        yield
    finally:
        runner.graphs, runner.mixed = graphs, mixed
