"""Which model family serves a checkpoint: the one place that names the families.

A checkpoint's config.json names its family by `model_type` (or, lacking one, `architectures`);
each family is a package under engine/models/ whose loader.py exposes `Model` (its `ModelFamily`
class), `load_config(model_dir)` and `load_model(model_dir, dtype, device, tokenizer=, tp=)`.
Families are imported on first use.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

from engine.models.config import ConfigError

# model_type -> the family's loader module
FAMILIES = {
    "deepseek_v4": "engine.models.deepseek_v4.loader",
    "deepseek_v41": "engine.models.deepseek_v41.loader",
    "deepseek_v41_text": "engine.models.deepseek_v41.loader",
}
# architectures -> model_type, for configs that carry no model_type
ARCHITECTURES = {
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV41ForCausalLM": "deepseek_v41",
    "DeepseekV41ForConditionalGeneration": "deepseek_v41",
}
DEFAULT_MODEL_TYPE = "deepseek_v4"  # DeepSeek's own V4 configs name neither


def model_type_of(raw: dict) -> str:
    model_type = raw.get("model_type")
    if model_type is None:
        known = [ARCHITECTURES[a] for a in raw.get("architectures") or () if a in ARCHITECTURES]
        model_type = known[0] if known else DEFAULT_MODEL_TYPE
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: model_type {model_type!r} is not served here (one of {sorted(FAMILIES)})")
    return model_type


def family(model_dir: str | Path) -> ModuleType:
    """The loader module of the family serving the checkpoint in `model_dir`."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    return importlib.import_module(FAMILIES[model_type_of(json.loads(path.read_text()))])


def load_config(model_dir: str | Path):
    return family(model_dir).load_config(model_dir)


def load_model(model_dir: str | Path, dtype="auto", device="cpu", **kwargs):
    """The family's model for `model_dir`, weights loaded (kwargs: tokenizer, tp, as the family takes them)."""
    return family(model_dir).load_model(model_dir, dtype, device, **kwargs)


def tiny_checkpoint_writer() -> ModuleType:
    """The module that writes the tiny default checkpoint (`model: "tiny"`): DeepSeek-V4's
    random_checkpoint (WRITER_VERSION, write_checkpoint)."""
    return importlib.import_module("engine.models.deepseek_v4.random_checkpoint")
