"""loadtest.vs_engine: the serving-vs-engine table from a Triton sweep, a bench_engine run and an
optional OpenAI sweep; levels matched by users, client-bound runs named, missing inputs empty."""

from __future__ import annotations

import json

import pytest

from loadtest import vs_engine


def sweep(levels: dict[int, float], bound: tuple[int, ...] = ()) -> dict:
    return {"levels": [{"concurrency": c, "output_tok_per_s": tok, "ttft_ms": {"p50": 10.0}, "itl_ms": {"p50": 2.0},
                        "e2e_ms": {"p50": 100.0}, "client_bound": c in bound, "failure": None}
                       for c, tok in levels.items()]}


def engine(levels: dict[int, float]) -> dict:
    return {"results": [{"mode": "offline", "concurrency": 8, "output_tok_s": 1e9, "ttft_ms": {}, "itl_ms": {},
                         "e2e_ms": {}},
                        *({"mode": "online", "concurrency": c, "output_tok_s": tok, "ttft_ms": {"p50": 5.0},
                           "itl_ms": {"p50": 1.0}, "e2e_ms": {"p50": 90.0}, "saturation": {"client_bound": False}}
                          for c, tok in levels.items())]}


def test_ratio_table(tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.json" for name in ("triton", "engine", "openai")}
    paths["triton"].write_text(json.dumps(sweep({1: 400.0, 150: 3681.0}, bound=(150,))))
    paths["engine"].write_text(json.dumps(engine({1: 429.0, 150: 10936.0})))
    paths["openai"].write_text(json.dumps(sweep({1: 380.0})))
    out = tmp_path / "rows.json"
    assert vs_engine.main([str(paths["triton"]), str(paths["engine"]), "--openai", str(paths["openai"]),
                           "--json", str(out)]) == 0
    one, many = json.loads(out.read_text())["rows"]
    assert one["triton_vs_engine"] == pytest.approx(400 / 429) and one["openai_vs_triton"] == pytest.approx(0.95)
    assert many["triton_vs_engine"] == pytest.approx(3681 / 10936) and many["client_bound"] == ["triton"]
    assert many["openai_tok_s"] is None and many["openai_vs_triton"] is None  # that level was not run
    table = capsys.readouterr().out
    assert "| 1 | 429.0 | 400.0 | 0.93x | 380.0 | 0.95x |" in table and table.rstrip().endswith("| triton |")
    assert vs_engine.main([str(paths["triton"]), str(tmp_path / "missing.json")]) == 1


def test_openai_against_triton_alone(tmp_path, capsys):
    """The serving_vs_openai suite's form: no engine-direct run, the OpenAI / Triton column only."""
    triton, openai = tmp_path / "triton.json", tmp_path / "openai.json"
    triton.write_text(json.dumps(sweep({1: 400.0, 32: 5000.0})))
    openai.write_text(json.dumps(sweep({1: 380.0, 32: 5500.0})))
    out = tmp_path / "rows.json"
    assert vs_engine.main([str(triton), "--openai", str(openai), "--json", str(out)]) == 0
    one, many = json.loads(out.read_text())["rows"]
    assert one["engine_tok_s"] is None and one["triton_vs_engine"] is None
    assert one["openai_vs_triton"] == pytest.approx(0.95) and many["openai_vs_triton"] == pytest.approx(1.1)
    assert "| 32 | - | 5,000.0 | - | 5,500.0 | 1.10x |" in capsys.readouterr().out
    assert vs_engine.main([str(triton)]) == 1  # nothing to compare Triton with
