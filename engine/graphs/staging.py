"""Two pinned host buffers for one static batch's packed inputs, used by alternate replays.

A step that stays in flight (async scheduling: engine/in_flight.py) is followed by the next step's
packing before anything waited for it, while its own host-to-device copy may still be queued on the
GPU behind the step before: packing into the buffer that copy reads would change its inputs. The
engine reads a step back before the step after next packs, so two buffers suffice. One pair per
static batch: the runner's decode graphs (and DSpark's plain-step graphs on the same batch), the
mixed-step graphs, DSpark's drafter graphs.
"""

from __future__ import annotations

import torch


class StagingPair:
    def __init__(self, shape, pin: bool):
        self.buffers = [torch.empty(shape, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.turn = 0

    @property
    def current(self) -> torch.Tensor:
        """The buffer of the step being packed (and copied by its replay)."""
        return self.buffers[self.turn % 2]

    def next(self) -> torch.Tensor:
        """The other buffer, now current: the one the step before the last one copied from."""
        self.turn += 1
        return self.current
