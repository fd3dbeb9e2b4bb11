"""The headline serving table: sweeps of one curve merged (a curve split over device calls), each
level's row and flags, the curve read at 20 and 50 tok/s per user across the files, and sweeps of
different configurations refused."""

import json
from dataclasses import asdict

import pytest

from loadtest import headline
from loadtest.workloads import WorkloadConfig


def level(users, tpot_ms, tok_s, e2e_s=5.0, window_s=30.0, **extra):
    return {"concurrency": users, "output_tok_per_s": tok_s, "output_tok_per_s_per_gpu": tok_s,
            "tpot_ms": {"mean": tpot_ms}, "ttft_ms": {"p50": 100.0 * users, "p90": 300.0 * users},
            "itl_ms": {"p50": tpot_ms}, "e2e_ms": {"p50": 1e3 * e2e_s}, "window_s": window_s, "requests": 10,
            "server": {"prefix_hit_ratio": 0.0}, "client_bound": False, "failure": None, **extra}


def sweep(label, levels, engine_args=None):
    return {"label": label, "protocol": "grpc", "gpus": 1, "levels": levels,
            "workload": asdict(WorkloadConfig(input_len="1024", output_len="128")),
            "server": {"serve": True, "model": "/ckpt", "engine_args": engine_args or {"max_num_seqs": 256}}}


def test_two_sweeps_make_one_curve_read_across_them(tmp_path, capsys):
    low = sweep("low", [level(1, 12.5, 80.0), level(8, 16.0, 500.0),
                        level(16, 20.0, 700.0, client_bound=True)])
    high = sweep("high", [level(32, 40.0, 800.0, e2e_s=20.0, window_s=30.0),
                          level(64, 100.0, 640.0, failure="no request completed")])
    a, b, out = tmp_path / "low.json", tmp_path / "high.json", tmp_path / "table.json"
    a.write_text(json.dumps(low))
    b.write_text(json.dumps(high))
    assert headline.main([str(b), str(a), "--at", "20,30,50", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["labels"] == ["high", "low"] and "levels" not in result  # records stay in the sweeps
    assert [r["users"] for r in result["rows"]] == [1, 8, 16, 32, 64]
    flags = {r["users"]: r["flags"] for r in result["rows"]}
    assert flags[1] == "" and flags[16] == "client-bound"
    assert flags[32] == "short window (30 s, E2E p50 20.0 s)" and flags[64].startswith("FAILED")
    at20, at30, at50 = result["at"]
    # 30 tok/s per user: between c=16 (50 tok/s per user, 700) of one file and c=32 (25, 800) of the other
    assert at30["output_tok_per_s_per_gpu"] == pytest.approx(780.0) and at30["note"] is None
    assert at50["output_tok_per_s_per_gpu"] == pytest.approx(700.0) and not at50["lower_bound"]
    # below every measured level (the failed c=64 is off the curve): c=32's throughput, a lower bound
    assert at20["output_tok_per_s_per_gpu"] == pytest.approx(800.0) and at20["lower_bound"]
    table = capsys.readouterr().out
    assert table.startswith("high, low: random, input 1024 tokens, output 128, grpc, 1 GPU")
    assert "| 16 | 700.0 | 700.0 | 50.0 | 1,600 / 4,800 | 20.0 | 5,000 | 0% | client-bound |" in table
    assert "- at 50 tok/s per user: 700.0 output tok/s per GPU" in table
    assert "- at 20 tok/s per user: >= 800.0 output tok/s per GPU (every level is above 20" in table


def test_sweeps_of_different_configurations_or_the_same_level_are_refused(tmp_path, capsys):
    base = sweep("a", [level(1, 12.5, 80.0)])
    other = sweep("b", [level(8, 16.0, 500.0)], engine_args={"max_num_seqs": 160})
    with pytest.raises(ValueError, match="engine_args differ"):
        headline.headline([base, other], [20.0])
    with pytest.raises(ValueError, match=r"users \[1\] measured by more than one sweep"):
        headline.headline([base, sweep("c", [level(1, 12.0, 82.0)])], [20.0])
    path = tmp_path / "not_a_sweep.json"
    path.write_text("{}")
    assert headline.main([str(path)]) == 1 and "not a loadtest.sweep result" in capsys.readouterr().err
