"""The serving_vs_engine suites' CPU twin end to end: the engine alone, a sweep through a real
tritonserver and one through the OpenAI front (the tiny model, 1 and 4 users), and the ratio
table from all three: the steps the H200 suites split between two device calls, at sizes a CPU
can take."""

from __future__ import annotations

import pytest

from benchmarks.runner import run_suite
from benchmarks.suites import SUITES

pytestmark = pytest.mark.slow


def test_serving_vs_engine_on_the_cpu(tmp_path):
    cpu = SUITES["serving_vs_engine_cpu"]
    h200 = [s.key for name in ("serving_vs_engine", "serving_vs_openai") for s in SUITES[name].steps]
    assert [s.key for s in cpu.steps] == list(dict.fromkeys(k for k in h200 if k != "checkpoint"))
    result = run_suite(cpu, work=tmp_path)
    steps = {s["name"]: s for s in result["steps"]}
    assert result["ok"], {k: (s.get("rc"), s["output_tail"][-5:]) for k, s in steps.items()}
    for name in ("triton", "openai"):  # every level measured, none client-bound (the sweep exits 3 otherwise)
        levels = steps[name]["figures"]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 4] and not any(lv["client_bound"] for lv in levels)
    rows = steps["ratio_openai"]["figures"]["rows"]
    assert [r["users"] for r in rows] == [1, 4]
    assert all(r["triton_vs_engine"] > 0 and r["openai_vs_triton"] > 0 for r in rows)
    assert "| users | engine-direct tok/s |" in "\n".join(steps["ratio"]["output_tail"])
