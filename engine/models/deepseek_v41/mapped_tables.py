"""DeepSeek-V4.1's Engram tables in host RAM, read by the GPU itself (`engram_tables: host`).

This rank's rows of each table are copied into host RAM in the stored format (FP8 rows + a ue8m0
scale per 32 channels as released) and, on CUDA, page-locked and mapped into the GPU's address space
(cudaHostRegister; under unified virtual addressing the GPU reads them at their host address). The
step's gather is then a kernel (kernels.v41_engram_gather) that loads just the rows it needs over PCIe,
dequantizes them and writes the model dtype: no host thread, no staging copy, no synchronisation.

Why the ids are known early enough: a row's n-gram ids depend only on its token and the
`engram_max_ngram_size - 1` tokens before it (engine/models/deepseek_v41/engram.py). The step's input
tokens are on the device when it starts (under async scheduling the last sampled ones have not
reached the host), and the look-back ones ride in its batch (the runner packs them: all prompt or
earlier sampled tokens). So the ids are hashed on the device, as with device tables, at the start of
the step, and every Engram layer's gather starts then on a side stream while the compute stream runs
the layers before that layer (layer 1 overlaps layer 0, layer 14 the 13 before it); the compute
stream waits on the gather's event only just before the Engram layer. Under CUDA-graph capture the
fork and join are captured too, so a decode or mixed graph holds the gather as a branch parallel to
its first layers: nothing waits on the host, and async scheduling and mixed-step graphs stay on.

Memory: registering pins the pages (they can no longer be swapped); it is done once at load and takes
seconds per 10 GB (logged). cudaHostRegister pins exactly the tables' bytes (torch's pinned allocator
would round each up to a power of two: 25 GB to 32 GB). Memory-mapped tables (`mmap`) are not
registered: that would pin, so read, every page of the file; they keep the host-thread gather
(engine/models/deepseek_v41/engram_tables.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

import kernels
from engine.models.deepseek_v41.engram_tables import StoredTable

log = logging.getLogger(__name__)


class _Registration:
    """A contiguous host tensor's bytes page-locked and mapped for the GPU; its __cuda_array_interface__
    hands torch that address as device memory. Unregistered when the last view of it goes."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device
        self.ptr, self.nbytes = host.data_ptr(), host.numel() * host.element_size()
        with torch.cuda.device(device):
            # flags 0: under unified virtual addressing the memory is mapped and portable, at its host address
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0))
        self.__cuda_array_interface__ = {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3}

    def __del__(self):
        try:
            if torch.cuda.is_current_stream_capturing():  # no sync inside a capture: keep the pages (leaked)
                return
            torch.cuda.synchronize(self.device)  # no kernel may still read the pages
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown: the process's mappings go with it
            pass


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over `host`'s own memory (registered above): torch ops and Triton kernels read it
    on the GPU at its host address, which is where unified virtual addressing maps it."""
    if not host.is_contiguous():
        raise ValueError("a mapped Engram table must be contiguous")
    # an explicit index: torch then takes the address as that device's without asking the driver
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    reg = _Registration(host, device)
    view = torch.as_tensor(reg, device=device).view(host.dtype).view(host.shape)
    if view.data_ptr() != reg.ptr:
        raise RuntimeError("torch copied the Engram table instead of viewing its host memory")
    return view


class MappedTables:
    """This rank's rows of each Engram layer's table in host RAM and the step's gathers on the device.

    start() hashes the step's ids and gathers every requested layer's rows on a side stream; the
    fetch it returns hands a layer its rows after the current stream waits on that layer's gather.
    On the CPU the same gather runs inline (the reference op on the tables in RAM)."""

    needs_host_tokens = False  # the ids are hashed on the device from the step's own tokens

    def __init__(self, tables: dict[int, StoredTable], spans: dict[int, tuple[int, int]], dtype: torch.dtype,
                 device: torch.device, copy: bool):
        """tables: memory-mapped (read_stored_table) or already in RAM; copy: into RAM first (the
        checkpoint's pages). A table already on the GPU is read where it is (tools/bench_v41_share.py
        compares the two)."""
        self.spans, self.dtype, self.device = spans, dtype, device
        self.cuda = device.type == "cuda"
        t0 = time.perf_counter()
        host = {layer: StoredTable(*(None if x is None else self._in_ram(x, copy) for x in (t.rows, t.scale)))
                for layer, t in tables.items()}
        self.copy_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.tables = {layer: StoredTable(*(None if x is None else self._for_device(x) for x in (t.rows, t.scale)))
                       for layer, t in host.items()}
        self.pin_s = time.perf_counter() - t0  # cudaHostRegister: pins every page
        # high priority: the gather's blocks take SMs as the first layers' free up, its PCIe reads start early
        self.stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        if self.cuda:
            self._check_reads(host)
            log.info("Engram: %.2f GB of table rows registered for the GPU in %.1f s (%.1f GB/s)", self.nbytes / 1e9,
                     self.pin_s, self.nbytes / 1e9 / max(self.pin_s, 1e-9))

    def _in_ram(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        if t.device.type != "cpu" or not copy:
            return t
        return torch.empty(t.shape, dtype=t.dtype).copy_(t)  # out of the file's pages

    def _for_device(self, t: torch.Tensor) -> torch.Tensor:
        return mapped(t, self.device) if self.cuda and t.device.type == "cpu" else t

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def gather(self, ids: torch.Tensor, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """ids [...] (whole-table rows) -> [..., D] in the model dtype: this rank's rows, zeros for the rest."""
        t = self.tables[layer]
        return kernels.v41_engram_gather(ids, t.rows, t.scale, self.spans[layer][0], self.dtype, out=out)

    def start(self, hash_ids: Callable[[], torch.Tensor], wanted: list[tuple[int, int]],
              rows: tuple[int, int]) -> Callable[[int], torch.Tensor]:
        """Begin the gathers of `wanted` ((k, layer): the layer's ids are hash_ids()[:, k], `rows` = its
        shape [T, cols]); -> fetch(layer), once per layer: its rows, ordered on the current stream."""
        if not self.cuda:
            ids = hash_ids()
            got = {layer: self.gather(ids[:, k], layer) for k, layer in wanted}
            return got.pop
        width = next(iter(self.tables.values())).rows.shape[-1]
        # allocated on the compute stream, which reads them after the join: no cross-stream frees
        outs = {layer: torch.empty(*rows, width, dtype=self.dtype, device=self.device) for _, layer in wanted}
        done = {}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ids = hash_ids()
            for k, layer in wanted:
                self.gather(ids[:, k], layer, out=outs[layer])
                done[layer] = torch.cuda.Event()
                done[layer].record(self.stream)

        def fetch(layer: int) -> torch.Tensor:
            torch.cuda.current_stream(self.device).wait_event(done.pop(layer))
            return outs.pop(layer)
        return fetch

    def _check_reads(self, host: dict[int, StoredTable]) -> None:
        """Once at load: the first and last row of each table read by the GPU equal the host's bytes (a
        platform whose GPU cannot use host addresses of registered memory fails here, not mid-serving)."""
        for layer in self.tables:
            lo, hi = self.spans[layer]
            ids = torch.tensor([lo, hi - 1], device=self.device)
            got = self.gather(ids, layer).cpu()
            h = host[layer]
            want = kernels.reference_of("v41_engram_gather")(ids.cpu(), h.rows.cpu(), None if h.scale is None
                                                             else h.scale.cpu(), lo, self.dtype)
            if not torch.equal(got, want):
                raise RuntimeError(f"Engram table of layer {layer}: rows read by the GPU from host memory differ from "
                                   "the host's; use engram_tables: mmap (host threads) or device")
