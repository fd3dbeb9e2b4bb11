"""backend/engine_setup.py: engine choice and model.json path resolution."""

import json

import pytest

from backend import engine_setup
from backend.engine_setup import build_engine, load_engine_args
from engine.models.deepseek_v4.random_checkpoint import WRITER_VERSION


def test_unknown_engine_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine 'tensorrt'.*native, vllm"):
        build_engine({"engine": "tensorrt", "model": "x"})


def test_model_paths_resolve_relative_to_model_json(tmp_path):
    (tmp_path / "ckpt").mkdir()
    model_json = tmp_path / "1" / "model.json"
    model_json.parent.mkdir()
    model_json.write_text(json.dumps({"model": "../ckpt", "max_model_len": 64}))
    args = load_engine_args(model_json)
    assert args["model"] == str((tmp_path / "ckpt").resolve())
    assert args["tokenizer"] == args["model"] and args["engine"] == "native" and args["max_model_len"] == 64
    model_json.write_text(json.dumps({"model": "deepseek-ai/DeepSeek-V4-Flash", "engine": "vllm"}))
    assert load_engine_args(model_json)["model"] == "deepseek-ai/DeepSeek-V4-Flash"  # a hub name


@pytest.mark.parametrize("text, message", [("{oops", "not valid JSON"), ("[1]", "JSON object")])
def test_bad_model_json(tmp_path, text, message):
    (tmp_path / "model.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_engine_args(tmp_path / "model.json")


def test_tiny_model_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    path = engine_setup.resolve_model_path("tiny", tmp_path)
    assert path == str(tmp_path / "tiny")
    config = tmp_path / "tiny" / "config.json"
    assert config.exists() and "compress_ratios" in config.read_text()
    mtime = config.stat().st_mtime_ns
    assert engine_setup.resolve_model_path("", tmp_path) == path and config.stat().st_mtime_ns == mtime
    (tmp_path / "tiny" / ".writer-version").write_text("1")  # a cache from an older writer is rewritten
    assert engine_setup.resolve_model_path("", tmp_path) == path and config.stat().st_mtime_ns != mtime
    assert (tmp_path / "tiny" / ".writer-version").read_text() == WRITER_VERSION
