"""Tensor-parallel ranks 1..N-1: spawned by rank 0 (the process that runs the scheduler), each
loads its share of the model (engine/parallel.py), builds a KV cache of rank 0's shape and a
runner (the same CUDA graphs), then runs every step rank 0 hands it.

Rank 0 schedules once. Per step it sends each worker, over its own pipe, the cache writes made
outside the forward (KVCache.mirror: a state slot reset, a prefix-cache restore) and the batch:
the host lists the runner packs and V4.1's Engram look-back ids (eager) or the decode graph's
packed buffer (replay; it holds the look-back). The
forward's collectives then keep the ranks in step; only rank 0 computes logits and samples.

Faults (docs/PARALLEL.md): a worker that raises exits; rank 0 watches every worker's process
sentinel and exits at once when one dies (its collectives could only hang), so the engine core
process's front sees a dead core, fails the requests in flight UNAVAILABLE and restarts it with
all its ranks. A hung worker hangs rank 0's step: the front's step watchdog kills the core.
Workers die with rank 0 (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading

import torch

from engine.args import EngineArgs
from engine.cache import KVCache
from engine.core_client import _python_executable, _without_main_module
from engine.forward_batch import HostBatch
from engine.models.registry import load_config
from engine.parallel import TensorParallel, check_parallel

log = logging.getLogger("deepseek.engine")

START_TIMEOUT_S = 600.0  # loading a real checkpoint's share takes minutes
GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits longer raises (gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def _join_group(kind: str, rank: int, world: int, port: int) -> None:
    if kind == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl" if kind == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


def cache_shape(cache: KVCache) -> dict:
    """What another rank needs to build a cache of the same shape (block ids mean the same there)."""
    boundary = any(st is not None and st.bnd_kv is not None for st in cache.comp_state + cache.index_state)
    return dict(block_size=cache.block_size, num_window_blocks=cache.scratch_window,
                num_full_blocks=cache.scratch_full, max_num_seqs=cache.scratch_slot, dtype=cache.dtype,
                boundary_state=boundary, window_snapshots=cache.snapshots is not None)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1 (and on the process group)."""

    def __init__(self, args: EngineArgs, model_dir, device: torch.device):
        n = args.tensor_parallel_size
        cfg = load_config(model_dir)
        check_parallel(cfg, n, args.enable_expert_parallel)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs; {torch.cuda.device_count()} visible")
        if torch.distributed.is_initialized():
            raise ValueError("tensor_parallel_size > 1: this process already runs a tensor-parallel engine "
                             "(one per process)")
        self.tp = TensorParallel(0, n, args.enable_expert_parallel)
        self.kind = device.type
        self.closing = False
        self.cache: KVCache | None = None
        port = _free_port()
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA
        executable = _python_executable()  # inside Triton's stub sys.executable is the stub
        if executable != sys.executable:
            ctx.set_executable(executable)
        self.procs, self.conns = [], []
        raw = dataclasses.asdict(args)
        omp = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = omp or "PASSIVE"  # spinning OpenMP threads starve the other ranks
        try:
            for rank in range(1, n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, name=f"dsv4-tp-rank{rank}", daemon=True,
                                args=(raw, str(model_dir), self.kind, rank, port, child, os.getpid()))
                with _without_main_module():
                    p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        finally:
            if omp is None:
                del os.environ["OMP_WAIT_POLICY"]
        atexit.register(self.close)
        try:
            _join_group(self.kind, 0, n, port)
        except BaseException:
            self.close()
            raise

    def start(self, cache: KVCache, runner_kwargs: dict) -> None:
        """Hand the workers the cache shape and runner settings (they build theirs, capturing the
        same graphs as rank 0 is about to), then mirror this cache's writes from now on."""
        self.cache = cache
        cache.mirror = []
        self._send(("start", (cache_shape(cache), runner_kwargs)))

    def wait_ready(self) -> None:
        """Every worker built its model, cache and graphs (or one failed: raise with its reason)."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            ready = multiprocessing.connection.wait([conn, p.sentinel], timeout=START_TIMEOUT_S)
            if conn in ready:
                msg = conn.recv()
                if msg == "ready":
                    continue
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {msg}")
            raise RuntimeError(f"tensor-parallel rank {rank} " + ("exited while starting" if ready else
                                                                 f"not ready after {START_TIMEOUT_S:.0f} s"))
        threading.Thread(target=self._watch, name="dsv4-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """A dead rank leaves this one's collectives waiting forever: exit at once (the front sees
        a dead engine core and restarts it, ranks included)."""
        sentinels = {p.sentinel: p for p in self.procs}
        dead = multiprocessing.connection.wait(list(sentinels))
        if self.closing:
            return
        p = sentinels[dead[0]]
        log.critical("tensor-parallel rank %s (pid %d) exited with %s: this engine exits too", p.name, p.pid,
                     p.exitcode)
        logging.shutdown()
        os._exit(1)

    # --- per step -----------------------------------------------------------------------------

    def _send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def _ops(self) -> list:
        ops, self.cache.mirror = self.cache.mirror, []
        return ops

    def step_eager(self, host_batch: HostBatch, lookback: torch.Tensor | None = None) -> None:
        """lookback: V4.1's Engram look-back ids [T, k] (engine/runner.py's lookback_ids)."""
        self._send(("eager", (self._ops(), host_batch, lookback)))

    def step_graph(self, size: int, packed) -> None:
        self._send(("graph", (self._ops(), size, packed)))

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.closing:
            return
        self.closing = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def worker_main(raw_args: dict, model_dir: str, kind: str, rank: int, port: int, conn, parent_pid: int) -> None:
    """A worker rank's process: join the group, load its share, build cache + runner, step."""
    from engine.core_process import die_with_parent

    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{rank}[%(process)d] %(levelname)s %(message)s")
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us
    try:
        import kernels
        from engine.llm_engine import family_load_args
        from engine.models.registry import load_model
        from engine.runner import ModelRunner
        from kernels import pdl

        args = EngineArgs(**raw_args)
        kernels.set_backend(args.kernels)
        _join_group(kind, rank, args.tensor_parallel_size, port)
        device = _device(kind, rank)
        pdl.configure(args.pdl, device)  # as rank 0's
        if kind == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tensor_parallel_size))
        tp = TensorParallel(rank, args.tensor_parallel_size, args.enable_expert_parallel)
        model = load_model(model_dir, args.dtype, device, tokenizer=args.tokenizer, tp=tp,
                           **family_load_args(args, model_dir))
        op, (shape, runner_kwargs) = pickle.loads(conn.recv_bytes())
        assert op == "start", op
        cache = model.cache_class(model.cfg, device=device, **shape)  # the family's cache (V4.1: CSA2 pools)
        runner = ModelRunner(model, cache, **runner_kwargs)
        if kind == "cuda":  # rank 0 compiles these in its warmup, outside any step: so do we
            from types import SimpleNamespace

            from engine.llm_engine import LLMEngine

            LLMEngine._warm_indexer_widths(SimpleNamespace(cfg=model.cfg, cache=cache, device=device,
                                                           block_size=cache.block_size,
                                                           max_model_len=runner_kwargs["max_model_len"]))
    except BaseException as e:  # noqa: BLE001 - tell rank 0 why, then exit
        log.exception("tensor-parallel rank %d failed to start", rank)
        try:
            conn.send(f"{type(e).__name__}: {e}")
        finally:
            os._exit(1)
    conn.send("ready")
    try:
        _serve(conn, model, cache, runner, device)
    except BaseException:  # noqa: BLE001 - rank 0 sees us exit and exits too
        log.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    os._exit(0)


def _serve(conn, model, cache: KVCache, runner, device: torch.device) -> None:
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "stop":
            return
        for op, op_args in payload[0]:
            getattr(cache, op)(*op_args)
        if kind == "eager":
            fb = payload[1].to_device(device)
            fb.lookback_ids = None if payload[2] is None else payload[2].to(device)
            model(fb, cache)
        else:  # a decode step replayed as rank 0 replays it
            size, packed = payload[1], payload[2]
            g = runner.graphs[size]
            runner.prefetch_host_inputs(size, packed)
            g.flat.copy_(torch.from_numpy(packed))
            g.graph.replay()
