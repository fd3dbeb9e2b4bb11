"""tools.bench_engine's --duration mode: closed-loop users on the engine itself, counted by
loadtest.window exactly as loadtest.sweep counts a level (the two legs of a serving_vs_engine
ratio), warm-up left out, in-flight requests cancelled and aborted at the stop."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest

from engine.llm import AsyncLLM
from loadtest.engine_direct import Level
from loadtest.sweep import summarize
from tools import bench_engine

T0 = 1_000_000.0


def rec(user, start, delta_ms, ok=True, cancelled=False, error=None):
    n = len(delta_ms)
    return {"user": user, "start": T0 + start, "ok": ok, "cancelled": cancelled, "error": error,
            "ttft_ms": delta_ms[0] if delta_ms else None, "e2e_ms": (delta_ms[-1] if delta_ms else 5.0) + 1.0,
            "tpot_ms": (delta_ms[-1] - delta_ms[0]) / (n - 1) if n > 1 else None, "output_tokens": n,
            "server_num_output_tokens": n if ok else None, "deltas": n, "prompt_tokens": 16, "delta_ms": delta_ms}


def test_window_result_counts_as_the_sweep_does():
    records = [rec(0, 0.0, [400.0, 900.0, 2600.0]), rec(0, 2.7, [300.0, 350.0, 700.0]),
               rec(1, 0.1, [2500.0, 4000.0, 4100.0, 6000.0]), rec(1, 6.2, [200.0, 2500.0, 4300.0]),
               rec(0, 3.5, [], ok=False, error="EngineOverloaded: full"),
               rec(0, 3.8, [150.0, 700.0], ok=False, cancelled=True)]
    marks = {"start": T0, "stopping": T0 + 8.0, "stop": T0 + 8.0}
    args = argparse.Namespace(duration=8.0, warmup=1.0, stop_timeout=0.0, workload="random")
    engine = bench_engine.window_result(Level(records, marks), args, concurrency=2)
    sweep = summarize(records, marks, concurrency=2, warmup_s=1.0)
    assert engine.accounting == "window" and engine.window["window_s"] == pytest.approx(7.0)
    # tokens in [1, 8] s: 1 (of 3; two came in the warm-up), 3, 4, 1 (of 3; two after the stop), 2 cancelled
    assert engine.output_tok_s == sweep["output_tok_per_s"] == pytest.approx(11 / 7.0)
    for key in ("request_per_s", "input_tok_per_s"):
        assert engine.window[key] == sweep[key]
    assert (engine.ttft_ms, engine.itl_ms, engine.e2e_ms, engine.window["tpot_ms"]) == \
        (sweep["ttft_ms"], sweep["itl_ms"], sweep["e2e_ms"], sweep["tpot_ms"])
    assert engine.ttft_ms["count"] == 2  # the two requests sent after the warm-up that completed
    assert (engine.window["errors"], engine.window["cancelled"]) == (sweep["errors"], sweep["cancelled"]) == (1, 1)


def test_duration_mode_on_the_tiny_engine(tmp_path):
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--preset", "tiny", "--concurrency", "1,4", "--input-len", "16", "--output-len", "64",
                              "--duration", "2", "--warmup", "0.5", "--stop-timeout", "0", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 4]
    for r in results:
        assert r["accounting"] == "window" and r["window"]["warmup_s"] == 0.5
        assert r["window"]["window_s"] == pytest.approx(1.5, abs=0.25) and r["output_tok_s"] > 0
        assert r["window"]["output_tok_per_s"] == r["output_tok_s"] and not r["saturation"]["client_bound"]
        cancelled = [x for x in r["records"] if x["cancelled"]]
        assert r["window"]["cancelled"] == len(cancelled) >= 1  # users are always mid-request at the stop
        assert all(x["output_tokens"] < 64 for x in cancelled)
    with pytest.raises(SystemExit):
        bench_engine.main(["--concurrency", "1", "--duration", "2", "--warmup", "2"])


def test_the_stop_aborts_in_flight_requests():
    async def run():
        async with AsyncLLM({"max_model_len": 256}) as engine:
            args = argparse.Namespace(workload="random", input_len=16, output_len=200, duration=1.0, warmup=0.0,
                                      stop_timeout=0.0, core_process=False, turns=1, turn_len=1)
            result = await bench_engine.windowed(engine, args, 3, engine.engine.cfg.vocab_size)
            deadline = time.monotonic() + 10
            while (engine.stats()["running"] or engine.stats()["waiting"]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return result, engine.stats()

    result, stats = asyncio.run(run())
    assert result.window["cancelled"] == 3  # 200-token requests outlive the 1 s window
    assert stats["running"] == stats["waiting"] == 0
