"""Which engine serves the model, and where its checkpoint is.

`model.json` (vLLM's engine-argument names plus `"engine"`) is read here once; the Triton
side (backend/model.py) and the launcher (backend/serve.py) both go through this file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.interface import AsyncEngine

ENGINES = ("native", "vllm")
# model.json keys for the Triton side (backend/model.py), not for the engine
BACKEND_OPTIONS = {
    "enable_log_requests": False,  # log each request's prompt and sampling parameters
    "max_prompt_bytes": None,  # text_input size limit; default 128 bytes per token of max_model_len
    "shutdown_file": None,  # backend.serve writes the drain deadline here before it sends SIGTERM
    "response_threads": None,  # threads that render and send streamed responses; default backend/model.py's
}
TINY_MODEL_NAMES = ("", "tiny")


def drained_marker(shutdown_file: str | os.PathLike) -> Path:
    """Where the model says its shutdown drain is over (nothing in flight, engine stopped): beside
    the shutdown file; backend.serve reads it."""
    return Path(f"{shutdown_file}.drained")


def finalize_marker(shutdown_file: str | os.PathLike) -> Path:
    """Where the model says Triton called its finalize (Triton let go of it and will exit)."""
    return Path(f"{shutdown_file}.finalize")


def build_engine(engine_args: dict) -> AsyncEngine:
    """Construct (not start) the engine named by `engine_args["engine"]` (default "native").
    The native engine's core runs in its own process unless `"engine_core_process": false`
    (then in-process `AsyncLLM`). The engine gets every other key unchanged. Engines are imported lazily: vllm is optional."""
    args = dict(engine_args)
    name = args.pop("engine", "native")
    core_process = args.pop("engine_core_process", True)
    if name == "native" and core_process:  # the engine core in a process of its own (docs/PROCESSES.md)
        from engine.core_client import CoreClient

        return CoreClient(args)
    if name == "native":
        from engine.llm import AsyncLLM

        return AsyncLLM(args)
    if name == "vllm":
        from backend.vllm_engine import VllmEngine

        return VllmEngine(args)
    raise ValueError(f"unknown engine {name!r} in model.json: expected one of {', '.join(ENGINES)}")


def pop_backend_options(args: dict) -> dict:
    """Take the Triton side's keys out of model.json's arguments (what is left is the engine's)."""
    return {key: args.pop(key, default) for key, default in BACKEND_OPTIONS.items()}


def load_engine_args(model_json: str | os.PathLike) -> dict:
    """Read model.json and resolve the model and tokenizer paths (see `resolve_model_path`)."""
    path = Path(model_json)
    try:
        args = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError(f"{path} must hold a JSON object of engine arguments")
    args.setdefault("engine", "native")
    args["model"] = resolve_model_path(args.get("model"), path.parent)
    tokenizer = args.get("tokenizer")
    args["tokenizer"] = args["model"] if tokenizer in (None, *TINY_MODEL_NAMES) else _resolve(tokenizer, path.parent)
    return args


def resolve_model_path(model: str | None, base_dir: str | os.PathLike) -> str:
    """Empty or "tiny": the tiny default checkpoint (written on first use). A relative path is
    relative to `base_dir` (model.json's folder) when it exists there; anything else (a hub name
    for vllm) is passed through."""
    if model is None or model.strip() in TINY_MODEL_NAMES:
        from engine.args import tiny_checkpoint_dir

        return str(tiny_checkpoint_dir())
    return _resolve(model, base_dir)


def _resolve(name: str, base_dir: str | os.PathLike) -> str:
    path = Path(name).expanduser()
    if path.is_absolute():
        return str(path)
    candidate = Path(base_dir) / path
    return str(candidate.resolve()) if candidate.exists() else name
