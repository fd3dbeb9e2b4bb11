"""The CUDA-graph capture toolkit every set of graphs uses (mixed steps, decode, speculative
verify / draft / rollback, V4.1's split steps)."""

from __future__ import annotations

import torch


def capture(run, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Two warm-up runs on a side stream (Triton JIT, allocator), then one capture into `pool`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-ups' blocks stay cached for the side stream; the pool needs them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def capture_buckets(buckets: list[int], make, forward, pool, capture_fn=capture) -> dict:
    """bucket -> make(bucket), whose `graph` captures forward(it) when `pool` is given (largest first:
    smaller graphs reuse its memory). capture_fn: the CPU tests pass an emulation of a CUDA graph."""
    out = {}
    for b in sorted(buckets, reverse=True):
        bk = make(b)
        if pool is not None:
            bk.graph, _ = capture_fn(lambda bk=bk: forward(bk), pool)
        out[b] = bk
    if pool is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def replay_bucket(bk, forward, fill=None) -> None:
    """One step of a bucket from capture_buckets: its packed staging to the device (one copy), then the
    graph's replay, or forward(bk) eagerly where nothing was captured (the CPU, no pool). fill(): writes
    what the host did not know into the copied batch (tokens of a step still in flight)."""
    bk.flat.copy_(bk.staging, non_blocking=True)
    if fill is not None:
        fill()
    if bk.graph is None:
        forward(bk)
    else:
        bk.graph.replay()
