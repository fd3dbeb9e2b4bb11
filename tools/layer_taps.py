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

EMBED = -1  # the key of the embedding's output in LayerTaps.rows


class LayerTaps:
    """rows: layer index (EMBED for the embedding) -> that layer's streams [hc_mult, hidden] (the
    embedding: [hidden]) of the last row of the latest forward."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: dict[int, torch.Tensor] = {}
        self._undo: list = []

    def _keep(self, layer: int, streams: torch.Tensor) -> None:
        self.rows[layer] = streams[-1].float().cpu()

    def __enter__(self) -> LayerTaps:
        m = self.model
        self._undo.append(m.embed.register_forward_hook(lambda mod, args, out: self._keep(EMBED, out)).remove)
        for i, block in enumerate(m.layers):
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
