"""kernels/per_weight.py: a value derived from a weight, kept until the weight is written or gone."""

import gc

import torch

from kernels.per_weight import PerWeight


def test_a_value_is_kept_per_weight_until_written_in_place_and_leaves_with_the_weight():
    cache = PerWeight()
    w, other = torch.ones(4), torch.ones(4)
    assert cache.get(w) is None
    value = cache.put(w, object(), extra=3)
    assert cache.get(w, extra=3) is value
    assert cache.get(w, extra=2) is None and cache.get(other, extra=3) is None  # another extra, an equal tensor
    w.add_(1)
    assert cache.get(w, extra=3) is None  # written in place: derive again
    with torch.inference_mode():
        frozen = torch.ones(4)
    assert cache.get(frozen) is None
    assert cache.put(frozen, 7) == 7 and cache.get(frozen) == 7
    del w, frozen
    gc.collect()
    assert len(cache._entries) == 0
