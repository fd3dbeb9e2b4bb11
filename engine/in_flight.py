"""A decode step launched but not yet read back (async scheduling).

The engine keeps at most one: its sampled token ids stay on the device for the next step to
read as inputs, and a pinned copy of (token, logprob, log-sum-exp and, where a request asked, its rank and top
logprobs) per row travels back behind it; `read()` waits only for that step, not for anything launched after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class InFlight:
    """A step launched but not yet read back (async scheduling)."""

    scheduled: list[tuple[Sequence, int]]
    token_ids: torch.Tensor  # [rows] on the device: what the next step reads as its inputs
    rows: dict[int, int]  # id(seq) -> row
    host: torch.Tensor  # float64 [3 (+ 1 + 2k), rows]: engine/sampler.pick_on_device's, filled by an async copy
    done: torch.cuda.Event | None

    @classmethod
    def launch(cls, scheduled: list[tuple[Sequence, int]], picked: torch.Tensor) -> InFlight:
        """picked: engine/sampler.pick_on_device's rows on the device; start copying them back."""
        cuda = picked.is_cuda
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=cuda)
        host.copy_(picked, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return cls(scheduled, picked[0].long(), {id(s): i for i, (s, _) in enumerate(scheduled)}, host, done)

    def read(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
