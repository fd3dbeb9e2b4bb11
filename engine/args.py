"""Engine arguments: vLLM's names where the meaning is the same, read once at the edge."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.spec.config import SpeculativeConfig


class InvalidEngineArgs(ValueError):
    pass


CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "NONE")
ENGRAM_TABLES = ("auto", "device", "host", "mmap")
CHUNK_BUDGETS = ("fixed", "adaptive")
PDL_MODES = ("auto", "on", "off")  # kernels/pdl.py's MODES (not imported: this module stays free of Triton)
KERNEL_BACKENDS = ("auto", "ref", "rounded", "reordered", "fused")  # kernels.BACKENDS (not imported: no torch)
_RENAMED = {"swa_decoder_replay": "swa_decoder_trim"}  # earlier names model.json files may still carry


@dataclass
class EngineArgs:
    model: str = ""  # checkpoint dir; "" or "tiny": the tiny default checkpoint
    tokenizer: str | None = None  # default: the model dir
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype
    device: str = "auto"  # auto: cuda when available
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # most prompt tokens of one sequence per step (0: the budget)
    # each step's budget: fixed (max_num_batched_tokens) or adaptive (engine/chunk_budget.py: the prefill chunk
    # the ITL target leaves after the running decodes, at least min_prefill_chunk, max_num_batched_tokens the cap);
    # the target: itl_target_ms, or (0) itl_target_factor x the decode step of a full batch (max_num_seqs)
    chunk_budget: str = "fixed"
    itl_target_ms: float = 0.0
    itl_target_factor: float = 2.0
    min_prefill_chunk: int = 256
    block_size: int | None = None  # default: lcm of compress ratios, >= 16
    enable_prefix_caching: bool = False
    swa_bounded_replay: bool = True
    # DeepSeek-V4.1's decoder trim (layers after the last KV source run a prefill on each sequence's
    # last sliding_window rows); None: follows swa_bounded_replay, as vLLM's one switch
    swa_decoder_trim: bool | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU (or explicit) byte budget for the KV pools
    num_gpu_blocks_override: int | None = None  # fixed number of compressed-KV blocks (tests)
    enforce_eager: bool = False
    # vLLM's compilation_config.cudagraph_mode values: FULL (decode and mixed prefill + decode steps
    # replay full graphs, engine/graphs/mixed.py), FULL_DECODE_ONLY (mixed steps eager), NONE (= enforce_eager)
    # FULL by default, as vLLM: on the H200 the mixed-step graphs' greedy streams equal the same padded
    # batches run eagerly (suite graphs_check, docs/PERF.md); padding alone moves bf16 ulps, as decode graphs' does
    cudagraph_mode: str = "FULL"
    # launch decode step N+1 before reading step N's tokens back (steps whose tokens are picked on the device: greedy
    # or drawn after temperature / top-k / top-p / min-p): the host's scheduling and output work overlaps the GPU's
    # step. None: on when running on CUDA.
    async_scheduling: bool | None = None
    seed: int = 0
    # vLLM's {"method": "mtp" | "dspark", "num_speculative_tokens": k}, k in 1..3 (engine/spec/config.py); None: off
    speculative_config: dict | str | None = None
    max_waiting_requests: int = 1024
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    # auto | ref | rounded (the references rounding as the kernels store: a float32 model) | reordered (rounded,
    # summing in another order) | fused (the kernels on any device: on the CPU under TRITON_INTERPRET=1, for tests)
    kernels: str = "auto"
    # programmatic dependent launch for the decode kernels (kernels/pdl.py): auto (on where the GPU and Triton
    # support it: sm_90+), on, off; DSV4_PDL=1 / 0 overrides it. Suite pdl_paths checks every served graph
    # path gives bit for bit what it gives without it
    pdl: str = "auto"
    # one host's GPUs (docs/PARALLEL.md): attention heads split over tensor_parallel_size ranks,
    # experts too with enable_expert_parallel (else each expert's intermediate slice); gloo on CPU
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1  # refused unless 1 (not implemented)
    data_parallel_size: int = 1  # refused unless 1 (not implemented)
    # DeepSeek-V4.1's Engram tables: on the GPU (device), in host RAM (host: pinned and read by the
    # GPU inside the step, engine/models/deepseek_v41/mapped_tables.py), memory-mapped from the
    # checkpoint (mmap: no copy in RAM, gathered by host threads, so the step's tokens must be on the
    # host when it is packed: no async scheduling), or auto: host when they would take more than a
    # quarter of a GPU (engine/models/deepseek_v41/engram_tables.py)
    engram_tables: str = "auto"
    # a step running longer than this means a hung GPU or a deadlock: the engine is declared dead
    # (requests in flight fail UNAVAILABLE, health turns false, the Triton model unloads). 0: off
    step_timeout_s: float = 60.0
    # the engine core process (engine/core_client.py): a core that dies or hangs is restarted this
    # many times, after core_restart_backoff_s, doubling per restart (at most 30 s); then it stays
    # dead (health false: the Triton model unloads). The count resets after 10 minutes of serving.
    core_restart_limit: int = 3
    core_restart_backoff_s: float = 1.0
    # tests only: a request whose prompt holds this text makes every step it is in raise
    # ("<marker>:fatal": an error classed as fatal, "<marker>:hang": the step blocks); see
    # docs/RELIABILITY.md. Never in production.
    fault_injection_marker: str | None = None
    engine: str = "native"

    @classmethod
    def of(cls, args: EngineArgs | Mapping) -> EngineArgs:
        """The one constructor convention of the engine's fronts (LLMEngine, AsyncLLM, CoreClient,
        LLM): engine arguments as EngineArgs or a mapping of vLLM's names."""
        return args if isinstance(args, EngineArgs) else cls.from_dict(dict(args))

    @classmethod
    def from_dict(cls, raw: dict) -> EngineArgs:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        raw = {_RENAMED.get(k, k): v for k, v in raw.items()}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise InvalidEngineArgs(f"unknown engine argument(s) {unknown}; known: {sorted(fields)}")
        args = cls(**raw)
        args.validate()
        return args

    def validate(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0 (0: off)"),
            (self.chunk_budget in CHUNK_BUDGETS, f"chunk_budget must be one of {CHUNK_BUDGETS}"),
            (self.itl_target_ms >= 0, "itl_target_ms must be >= 0 (0: itl_target_factor x the decode step)"),
            (self.itl_target_factor >= 1.0, "itl_target_factor must be >= 1 (a step holds the decodes at least)"),
            (self.min_prefill_chunk >= 1, "min_prefill_chunk must be >= 1"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_waiting_requests >= 0, "max_waiting_requests must be >= 0"),
            (self.step_timeout_s >= 0, "step_timeout_s must be >= 0 (0: no step watchdog)"),
            (self.kernels in KERNEL_BACKENDS, f"kernels must be one of {KERNEL_BACKENDS}"),
            (self.pdl in PDL_MODES, f"pdl must be one of {PDL_MODES}"),
            (self.cudagraph_mode in CUDAGRAPH_MODES, f"cudagraph_mode must be one of {CUDAGRAPH_MODES}"),
            (self.engram_tables in ENGRAM_TABLES, f"engram_tables must be one of {ENGRAM_TABLES}"),
            (self.core_restart_limit >= 0, "core_restart_limit must be >= 0"),
            (self.core_restart_backoff_s >= 0, "core_restart_backoff_s must be >= 0"),
            (self.engine == "native", "this is the native engine; engine must be 'native'"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.pipeline_parallel_size == 1, "pipeline_parallel_size must be 1: the native engine has no "
                                               "pipeline parallelism (tensor_parallel_size splits one host's GPUs)"),
            (self.data_parallel_size == 1, "data_parallel_size must be 1: the native engine has no data-parallel "
                                           "attention (run one engine per group of GPUs)"),
            (self.block_size is None or self.block_size >= 1, "block_size must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.fault_injection_marker is None or len(self.fault_injection_marker) >= 8,
             "fault_injection_marker must be at least 8 characters (tests only)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidEngineArgs(msg)
        try:
            spec = SpeculativeConfig.parse(self.speculative_config)
        except ValueError as e:
            raise InvalidEngineArgs(str(e)) from None
        if spec is not None and self.tensor_parallel_size > 1:  # the verify and MTP steps run on rank 0 alone
            raise InvalidEngineArgs("speculative_config is not supported with tensor_parallel_size > 1 yet")


def tiny_checkpoint_dir() -> Path:
    """The tiny default checkpoint, written once into the user cache (atomically), and again when
    the writer has changed since (a cache from an older version lacks e.g. the MTP layer)."""
    import shutil

    from engine.models.registry import tiny_checkpoint_writer

    writer = tiny_checkpoint_writer()

    root = Path(os.environ.get("DSV4_CACHE_DIR", Path.home() / ".cache" / "deepseek-v4-triton"))
    out, stamp = root / "tiny", ".writer-version"
    if (out / "config.json").exists() and (out / stamp).is_file() and (out / stamp).read_text() == writer.WRITER_VERSION:
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-"))
    writer.write_checkpoint(tmp, preset="tiny", seed=0)
    (tmp / stamp).write_text(writer.WRITER_VERSION)
    if out.exists():  # stale: moved aside first, so a reader never sees half of each
        old = Path(tempfile.mkdtemp(dir=root, prefix=".stale-"))
        try:
            out.rename(old / "tiny")
        except OSError:
            pass
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_dir(model: str) -> Path:
    if model in ("", "tiny", None):
        return tiny_checkpoint_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise InvalidEngineArgs(f"model {model!r}: no config.json there (a local DeepSeek-V4 checkpoint dir)")
    return path
