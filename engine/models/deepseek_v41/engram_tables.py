"""DeepSeek-V4.1's Engram tables memory-mapped from the checkpoint (`engram_tables: mmap`): the step's
rows gathered by host threads and copied to the device ahead of the layer that reads them; and what
every host placement shares: where the tables go (choose_placement) and reading them as stored.

The released tables hold most of the checkpoint's bytes (rows for every hashed n-gram bucket of
layers 1 and 14), far more than the rows a step reads (tokens x n-gram heads), so they can live in
host RAM (`host`: a copy in the stored format, read by the GPU itself: engine/models/deepseek_v41/mapped_tables.py)
or stay in the checkpoint's safetensors files, memory-mapped (`mmap`: no copy in RAM; the page cache
keeps the hot rows and is shared by every rank of the host). Under tensor parallelism each rank holds
only its row range (engine/models/deepseek_v41/shards.py) and the model sums the ranks' gathers.

Mapped file pages cannot be handed to the GPU without pinning (so reading) all of them, so `mmap`
gathers on the host. Why the ids are known early enough there: a row's n-gram ids depend only on its token and the
`engram_max_ngram_size - 1` tokens before it (engine/models/deepseek_v41/engram.py), all prompt
tokens or tokens already sampled, which the host holds when it packs the step (the runner's
look-back ids come from the host's token lists; async scheduling is off, so the last sampled token
is on the host too). So the ids are hashed on the host, before the
step runs; the gather for every Engram layer starts at once on host threads, each thread copying
its layer's rows as stored (FP8: half the bytes of bf16) to the device on a side stream and
dequantizing them there, while the device runs the layers before that Engram layer (layer 1 waits
behind layer 0 only, layer 14 behind 13 layers). The compute stream waits on the copy's event just
before the Engram layer. Decode CUDA graphs read the rows from static device buffers filled before
each replay (DeepseekV41.prefetch_host_inputs): no graph waits on the host, but the whole gather
comes before the replay.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.args import ENGRAM_TABLES
from engine.models.deepseek_v41.weights import dequantize_rows
from engine.models.weights import WeightsError, checkpoint_files

HOST_ABOVE = 0.25  # auto: tables above this share of one GPU's memory live in host RAM
GATHER_THREADS = 4  # per rank: a large step's rows split over them (index_select drops the GIL)
SPLIT_ABOVE = 4096  # rows of one layer's gather below which one thread does it
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "F8_E8M0": torch.uint8}


def choose_placement(arg: str, table_bytes: int, device: torch.device) -> str:
    """engram_tables `auto`: on the device unless the tables (this rank's share) would take more
    than HOST_ABOVE of the GPU's memory; the CPU's tables are host memory already."""
    if arg not in ENGRAM_TABLES:
        raise ValueError(f"engram_tables={arg!r}: choose from {ENGRAM_TABLES}")
    if arg != "auto":
        return arg
    if device.type != "cuda":
        return "device"
    total = torch.cuda.get_device_properties(device).total_memory
    return "host" if table_bytes > HOST_ABOVE * total else "device"


@dataclass
class StoredTable:
    """One table's rows [lo, hi) as stored: rows [n, D] (float, or e4m3 with `scale` [n, D / c])."""

    rows: torch.Tensor
    scale: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.scale) if t is not None)


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def read_stored_table(model_dir: str | Path, names: tuple[str, ...], lo: int, hi: int) -> StoredTable:
    """Rows [lo, hi) of the table stored under the first of `names` found (official or transformers'),
    memory-mapped (a view of the file's pages: nothing read yet), and its row scale when FP8 (read)."""
    for path in checkpoint_files(model_dir):
        start, header = _header(path)
        name = next((n for n in names if n in header), None)
        if name is None:
            continue
        rows = _rows(path, start, header[name], name, lo, hi, mmap=True)
        scale = None
        for s in (name[: -len(".weight")] + ".scale", name + "_scale_inv", name[: -len(".weight")] + ".weight_scale_inv"):
            if s in header:
                scale = _rows(path, start, header[s], s, lo, hi, mmap=False)  # 1/32 of the rows: read
        if rows.dtype == torch.float8_e4m3fn and scale is None:
            raise WeightsError(f"{path.name}: FP8 Engram table {name} has no row scale beside it")
        return StoredTable(rows, scale)
    raise WeightsError(f"{model_dir}: no Engram table among {names}")


def _rows(path: Path, start: int, entry: dict, name: str, lo: int, hi: int, mmap: bool) -> torch.Tensor:
    if entry["dtype"] not in _DTYPES:
        raise WeightsError(f"{path.name}: Engram table {name} is {entry['dtype']}: not supported")
    dtype, (n, d) = _DTYPES[entry["dtype"]], entry["shape"]
    width = d * torch.empty((), dtype=dtype).element_size()
    begin = start + entry["data_offsets"][0] + lo * width
    if hi > n:
        raise WeightsError(f"{path.name}: Engram table {name} has {n} rows, the config says more ({hi})")
    # copy-on-write: a private mapping torch may treat as writable; nothing ever writes to it
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=begin, shape=((hi - lo) * width,))
    t = torch.from_numpy(raw if mmap else np.array(raw)).view(dtype).view(hi - lo, d)
    return t


class HostTables:
    """This rank's rows of each Engram layer's table memory-mapped, and the step's gathers on host threads.

    gather(ids) starts one job per layer on host threads: rows by index (a row outside this rank's
    range: zeros), dequantized when stored in FP8, into a pinned staging buffer, then copied to
    the device on a side stream. rows(layer) hands the layer its device rows after the compute
    stream waits on that copy."""

    needs_host_tokens = True  # the ids are hashed on the host: the step's tokens must be there when it is packed

    def __init__(self, tables: dict[int, StoredTable], spans: dict[int, tuple[int, int]], dtype: torch.dtype,
                 device: torch.device):
        """tables: memory-mapped (read_stored_table)."""
        self.tables, self.spans, self.dtype, self.device = tables, spans, dtype, device
        self.cuda = device.type == "cuda"
        self.layer_pool = ThreadPoolExecutor(max_workers=max(1, len(tables)), thread_name_prefix="engram-layer")
        self.row_pool = ThreadPoolExecutor(max_workers=GATHER_THREADS, thread_name_prefix="engram-rows")
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging: dict[int, torch.Tensor] = {}
        self.copied: dict[int, torch.cuda.Event] = {}  # the last copy out of each layer's staging buffer
        self.pending: dict[int, Future] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def _stage(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned buffer of at least `shape` for `key` (grown, never shrunk)."""
        need = int(np.prod(shape))
        buf = self.staging.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, 1), dtype=dtype, pin_memory=self.cuda)
            self.staging[key] = buf
        return buf[:need].view(shape)

    def gather(self, ids: torch.Tensor, out: dict[int, torch.Tensor] | None = None) -> None:
        """ids: host [T, L, cols] table rows per Engram layer (k-th = k-th of `tables`). out: device
        buffers to fill (a decode graph's static ones), else fresh device tensors."""
        read = None
        if out is not None and self.cuda:  # the buffers are written only after what the device queued (a replay) read them
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream(self.device))
        for k, layer in enumerate(self.tables):
            self.pending[layer] = self.layer_pool.submit(self._gather_in_inference_mode, layer, ids[:, k],
                                                         None if out is None else out[layer], read)

    def _gather_in_inference_mode(self, layer: int, ids: torch.Tensor, dst: torch.Tensor | None,
                                  read: torch.cuda.Event | None):
        """Inference mode is per thread: a decode graph's static input (dst) may be an inference tensor, which a
        row thread may update in place only inside it."""
        with torch.inference_mode():
            return self._gather_rows(layer, ids, dst, read)

    def _gather_rows(self, layer: int, ids: torch.Tensor, dst: torch.Tensor | None, read: torch.cuda.Event | None):
        """Rows as stored into pinned staging (a row of another rank: zero bytes, so it dequantizes
        to exactly 0), copied as stored (FP8: half of bf16's bytes), dequantized on the device."""
        table, (lo, hi) = self.tables[layer], self.spans[layer]
        local = ids.reshape(-1) - lo
        mine = (local >= 0) & (local < hi - lo)
        idx = torch.where(mine, local, 0)
        if layer in self.copied:  # the previous step's copy out of the staging may still run (async scheduling)
            self.copied.pop(layer).synchronize()
        rows = self._stage((layer, "rows"), (idx.numel(), table.rows.shape[-1]), table.rows.dtype)
        scale = None if table.scale is None else self._stage((layer, "scale"), (idx.numel(), table.scale.shape[-1]),
                                                             table.scale.dtype)
        if idx.numel() < SPLIT_ABOVE:
            self._rows_into(table, idx, mine, rows, scale)
        else:  # a prefill's rows: split over the row threads
            parts = [slice(c[0].item(), c[-1].item() + 1) for c in torch.arange(idx.numel()).tensor_split(GATHER_THREADS)]
            list(self.row_pool.map(lambda c: self._rows_into(table, idx[c], mine[c], rows[c],
                                                             None if scale is None else scale[c]), parts))
        shape = (*ids.shape, table.rows.shape[-1])
        if not self.cuda:
            out = self._dequantize(rows, scale).view(shape)
            return out if dst is None else dst.copy_(out)
        with torch.cuda.stream(self.copy_stream):
            stored = rows.to(self.device, non_blocking=True)
            scales = None if scale is None else scale.to(self.device, non_blocking=True)
            dev = self._dequantize(stored, scales).view(shape)
            if dst is not None:
                self.copy_stream.wait_event(read)
                dev = dst.copy_(dev)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.copied[layer] = done
        return dev, done

    def _dequantize(self, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """As the loader dequantizes a device table (weights.dequantize_rows, then the model dtype)."""
        if scale is None:  # a copy: the rows must outlive the staging buffer they came through
            return rows.to(self.dtype, copy=True)
        return dequantize_rows(rows, scale).to(self.dtype)

    @staticmethod
    def _rows_into(table: StoredTable, idx: torch.Tensor, mine: torch.Tensor, rows: torch.Tensor,
                   scale: torch.Tensor | None) -> None:
        torch.index_select(table.rows, 0, idx, out=rows)
        rows.view(torch.uint8)[~mine] = 0  # zero bytes: 0 in every float format and in e4m3
        if scale is not None:
            torch.index_select(table.scale, 0, idx, out=scale)

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's gathered rows on the device, ordered after their copy on the compute stream."""
        got = self.pending.pop(layer).result()
        if not self.cuda:
            return got
        dev, done = got
        torch.cuda.current_stream(self.device).wait_event(done)
        dev.record_stream(torch.cuda.current_stream(self.device))
        return dev

    def wait_all(self) -> None:
        """Join every gather of the step (a decode graph's buffers must be filled before replay)."""
        for layer in list(self.pending):
            self.rows(layer)
