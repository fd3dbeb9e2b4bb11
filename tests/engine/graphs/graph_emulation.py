"""A CUDA graph's capture and replay, emulated on the CPU, for the mixed-step graphs' tests.

`capture(run, pool)` has engine.graphs.capture.capture's signature. It runs `run` once and records
every torch op (at the aten level, through a TorchDispatchMode) and every Triton launch (the
interpreter's) with the arguments it was given; `replay()` runs the records again with exactly
those arguments. That is what a CUDA graph does: the same tensors (a graph's fixed addresses) and
the same host values (ints, grids, shapes, table widths, loop bounds: baked in at capture), so a
step whose forward derives a host value from its batch replays it wrong here as on the GPU.
As on the GPU, capture refuses host reads of tensor data (item, tolist, numpy, nonzero, boolean
masks: a graph cannot sync), and every allocation (empty) comes back poisoned at each replay (NaN,
or a huge int): a graph's pool holds whatever ran there last, so a kernel reading memory that
nothing wrote this step shows up as NaN or an index error, not as a silent stale value.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# ops whose result (or its shape) needs the tensor's data on the host: a capture error on the GPU
_HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default, aten.equal.default,
               aten.masked_select.default, aten.unique_dim.default, aten._unique2.default, aten.unique_consecutive.default,
               aten.bincount.default, aten.repeat_interleave.Tensor}
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
          aten.new_empty_strided.default}


class HostRead(RuntimeError):
    """The captured step read device data on the host (it would fail to capture, or bake it in)."""


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _aliases(func, args, kwargs, out) -> bool:
    """The op returned views of its inputs (view ops; `to` / `contiguous` / `reshape` when they had
    nothing to do), not new memory: its replay is its base's. In-place and out= ops are not views."""
    if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return False
    ins = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    outs = _tensors(out)
    return bool(outs) and all(t.untyped_storage().data_ptr() in ins for t in outs)


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max // 2)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.graph.paused:
            return func(*args, **kwargs)
        bool_index = func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in _HOST_READS or bool_index:
            raise HostRead(f"{func} during a CUDA-graph capture: the step reads device data on the host")
        out = func(*args, **kwargs)
        self.graph.records.append(("op", func, args, kwargs, out, _aliases(func, args, kwargs, out)))
        return out


class EmulatedGraph:
    def __init__(self):
        self.records: list[tuple] = []
        self.paused = False
        self.replays = 0

    @contextlib.contextmanager
    def _pause(self):
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was

    def capture(self, run):
        from triton.runtime.interpreter import InterpretedFunction

        graph, launch = self, InterpretedFunction.run

        def recorded_launch(fn, *args, grid, warmup, **kwargs):
            if not graph.paused and not warmup:
                graph.records.append(("triton", fn, args, grid, kwargs))
            with graph._pause():  # the interpreter's own copies are not the step's ops
                return launch(fn, *args, grid=grid, warmup=warmup, **kwargs)

        def refuse(name):
            method = getattr(torch.Tensor, name)

            def read(t, *a, **k):
                if not graph.paused:
                    raise HostRead(f"Tensor.{name} during a CUDA-graph capture: the step reads device data on the host")
                return method(t, *a, **k)
            return method, read

        host_methods = {name: refuse(name) for name in ("tolist", "numpy")}
        InterpretedFunction.run = recorded_launch
        for name, (_, read) in host_methods.items():
            setattr(torch.Tensor, name, read)
        try:
            with _Recorder(self):
                out = run()
        finally:
            InterpretedFunction.run = launch
            for name, (method, _) in host_methods.items():
                setattr(torch.Tensor, name, method)
        return out

    def replay(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.replays += 1
        with self._pause(), torch.inference_mode():  # the model's forward runs in inference mode
            for rec in self.records:
                if rec[0] == "triton":
                    _, fn, args, grid, kwargs = rec
                    InterpretedFunction.run(fn, *args, grid=grid, warmup=False, **kwargs)
                    continue
                _, func, args, kwargs, out, view = rec
                if view:  # the recorded view already aliases its (replayed) base
                    continue
                if func in _EMPTY:
                    _poison(out)
                    continue
                new = func(*args, **kwargs)  # in-place / out= ops write the recorded tensors again
                for o, n in zip(_tensors(out), _tensors(new)):
                    if o is not n:
                        o.copy_(n)


def capture(run, pool=None) -> tuple[EmulatedGraph, object]:
    """engine.graphs.capture.capture's stand-in on the CPU: record `run` once; replay() reruns it."""
    graph = EmulatedGraph()
    return graph, graph.capture(run)
