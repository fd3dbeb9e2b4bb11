"""Values derived from a weight tensor once, not at every call (a split of mHC's mixing weights, the largest MXFP4
scale byte): kept by the tensor's identity, computed again after an in-place write. Inference tensors keep no version
counter, so a write to one goes unseen: the engine loads weights once and never writes them in place. An entry
leaves with its tensor."""

from __future__ import annotations

import weakref

import torch


class PerWeight:
    """One derived value per weight tensor (and `extra`, what else the value depends on)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, tuple, object]] = {}  # id(tensor) -> (tensor, stamp, value)

    @staticmethod
    def _stamp(t: torch.Tensor, extra) -> tuple:
        return (None if t.is_inference() else t._version, extra)

    def get(self, t: torch.Tensor, extra=None):
        """The value stored for t (with this extra, since its last write), else None."""
        hit = self._entries.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == self._stamp(t, extra):
            return hit[2]
        return None

    def put(self, t: torch.Tensor, value, extra=None):
        """Store value for t; returns it."""
        key = id(t)
        self._entries[key] = (weakref.ref(t, lambda _, k=key: self._entries.pop(k, None)), self._stamp(t, extra), value)
        return value
