"""Which engine serves the model, and where its checkpoint is.

`model.json` (vLLM's engine-argument names plus `"engine"`) is read here once; the Triton
side (backend/model.py) and the launcher (backend/serve.py) both go through this file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from backend.engine.interface import AsyncEngine

ENGINES = ("native", "vllm")
TINY_MODEL_NAMES = ("", "tiny")


def build_engine(engine_args: dict) -> AsyncEngine:
    """Construct (not start) the engine named by `engine_args["engine"]` (default "native").
    The engine gets every other key unchanged. Engines are imported lazily: vllm is optional."""
    args = dict(engine_args)
    name = args.pop("engine", "native")
    if os.environ.get("DSV4_DEV_FAKE_ENGINE"):  # DEV-ONLY-REMOVE
        import importlib.util  # DEV-ONLY-REMOVE
        spec = importlib.util.spec_from_file_location("fake_engine", os.environ["DSV4_DEV_FAKE_ENGINE"])  # DEV-ONLY-REMOVE
        mod = importlib.util.module_from_spec(spec)  # DEV-ONLY-REMOVE
        spec.loader.exec_module(mod)  # DEV-ONLY-REMOVE
        return mod.FakeEngine(args)  # DEV-ONLY-REMOVE
    if name == "native":
        from backend.engine.llm import AsyncLLM

        return AsyncLLM(args)
    if name == "vllm":
        from backend.vllm_engine import VllmEngine

        return VllmEngine(args)
    raise ValueError(f"unknown engine {name!r} in model.json: expected one of {', '.join(ENGINES)}")


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
        return str(tiny_checkpoint())
    return _resolve(model, base_dir)


def _resolve(name: str, base_dir: str | os.PathLike) -> str:
    path = Path(name).expanduser()
    if path.is_absolute():
        return str(path)
    candidate = Path(base_dir) / path
    return str(candidate.resolve()) if candidate.exists() else name


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "deepseek-v4-triton"


def tiny_checkpoint(out_dir: str | os.PathLike | None = None) -> Path:
    """The tiny test checkpoint, written once (atomically: concurrent servers may race)."""
    out = Path(out_dir) if out_dir is not None else cache_dir() / "tiny"
    if (out / "config.json").exists():
        return out
    from tools.make_tiny_checkpoint import write_checkpoint

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        write_checkpoint(str(tmp), preset="tiny", seed=0)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
