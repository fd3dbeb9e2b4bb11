"""loadtest.vs_engine: the serving-vs-engine table from a Triton sweep, a bench_engine run and an
optional OpenAI sweep; levels matched by users, client-bound runs named, missing inputs empty."""

from __future__ import annotations

import json

import pytest

from loadtest import vs_engine


def sweep(levels: dict[int, float], bound: tuple[int, ...] = (), duration: float = 30.0, warmup: float = 0.0) -> dict:
    return {"duration_s": duration, "warmup_s": warmup, "levels": [{"concurrency": c, "output_tok_per_s": tok, "ttft_ms": {"p50": 10.0}, "itl_ms": {"p50": 2.0},
                        "e2e_ms": {"p50": 100.0}, "client_bound": c in bound, "failure": None}
                       for c, tok in levels.items()]}


def engine(levels: dict[int, float], window: tuple[float, float] | None = None) -> dict:
    """window: (duration, warm-up) of a --duration run; None: a --requests-per-user run ("drain")."""
    counted = ({"accounting": "window", "window": {"duration_s": window[0], "warmup_s": window[1]}} if window
               else {"accounting": "drain"})
    return {"results": [{"mode": "offline", "concurrency": 8, "output_tok_s": 1e9, "ttft_ms": {}, "itl_ms": {},
                         "e2e_ms": {}},
                        *({"mode": "online", "concurrency": c, "output_tok_s": tok, "ttft_ms": {"p50": 5.0},
                           "itl_ms": {"p50": 1.0}, "e2e_ms": {"p50": 90.0}, "saturation": {"client_bound": False},
                           **counted}
                          for c, tok in levels.items())]}


def test_ratio_table(tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.json" for name in ("triton", "engine", "openai")}
    paths["triton"].write_text(json.dumps(sweep({1: 400.0, 150: 3681.0}, bound=(150,))))
    paths["engine"].write_text(json.dumps(engine({1: 429.0, 150: 10936.0}, window=(30.0, 0.0))))
    paths["openai"].write_text(json.dumps(sweep({1: 380.0})))
    out = tmp_path / "rows.json"
    assert vs_engine.main([str(paths["triton"]), str(paths["engine"]), "--openai", str(paths["openai"]),
                           "--json", str(out)]) == 0
    one, many = json.loads(out.read_text())["rows"]
    assert one["triton_vs_engine"] == pytest.approx(400 / 429) and one["openai_vs_triton"] == pytest.approx(0.95)
    assert many["triton_vs_engine"] == pytest.approx(3681 / 10936) and many["client_bound"] == ["triton"]
    assert many["openai_tok_s"] is None and many["openai_vs_triton"] is None  # that level was not run
    assert one["counted_apart"] == [] and one["counted"]["engine"] == one["counted"]["triton"] == "window 0+30 s"
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


def test_runs_counted_differently_are_marked(tmp_path, capsys):
    """A ratio of a windowed sweep to engine-direct's drain-inclusive rate, or to a window of another
    warm-up, is marked in its row, the table and a warning; the same window is not."""
    triton, eng = tmp_path / "triton.json", tmp_path / "engine.json"
    triton.write_text(json.dumps(sweep({64: 900.0, 150: 1200.0}, duration=45.0, warmup=15.0)))
    for window, apart in ((None, "triton window 15+30 s / engine drain"),
                          ((45.0, 0.0), "triton window 15+30 s / engine window 0+45 s"), ((45.0, 15.0), None)):
        eng.write_text(json.dumps(engine({64: 1000.0, 150: 1600.0}, window=window)))
        out = tmp_path / "rows.json"
        assert vs_engine.main([str(triton), str(eng), "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        printed = capsys.readouterr().out
        assert all(r["counted_apart"] == ([apart] if apart else []) for r in rows)
        assert rows[1]["triton_vs_engine"] == pytest.approx(0.75)  # marked, still computed
        assert ("DIFFERENT: " + apart in printed and "warning:" in printed) if apart else \
            ("DIFFERENT" not in printed and "| window 15+30 s | no |" in printed)
