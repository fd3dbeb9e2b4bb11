"""The CPU emulation of a CUDA graph (tests/engine/graphs/graph_emulation.py) does to a step what a graph
does: a replay reads its tensors as they are then, keeps every host value as captured, finds
allocations holding garbage, and a capture refuses to read tensor data on the host."""

import pytest
import torch

from tests.engine.graphs.graph_emulation import HostRead, capture


def test_replay_reads_tensors_now_but_host_values_as_captured():
    x = torch.arange(6, dtype=torch.float32)
    rows = [2]  # a host value derived from the batch, as a token count would be
    graph, out = capture(lambda: (x[:rows[0]] * 2).sum(0, keepdim=True) + x.float().max())
    assert out.item() == 2 + 5
    x.add_(10)
    rows[0] = 4
    graph.replay()
    assert out.item() == (10 + 11) * 2 + 15  # new data, old row count: what a graph replays


def test_in_place_writes_replay_into_the_same_tensors():
    cache = torch.zeros(4)
    idx = torch.tensor([1])
    graph, _ = capture(lambda: cache.index_copy_(0, idx, torch.ones(1) * 3))
    idx.fill_(2)
    graph.replay()
    assert cache.tolist() == [0.0, 3.0, 3.0, 0.0]


def test_unwritten_allocations_come_back_poisoned():
    graph, out = capture(lambda: torch.empty(3) + 1)
    graph.replay()
    assert torch.isnan(out).all()


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t[t > 1],
                                  lambda t: t.nonzero(), lambda t: int(t.max())])
def test_capture_refuses_host_reads(read):
    t = torch.arange(4)
    with pytest.raises(HostRead):
        capture(lambda: read(t))
