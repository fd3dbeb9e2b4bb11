"""What the sweep computes from records (windowed rates, percentiles), the metrics it reads, and
the report it draws: no server needed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadtest import report, scrape
from loadtest.sweep import parse_levels, parse_seconds, read_records, summarize
from loadtest.window import percentiles

T0 = 1_000_000.0


def rec(start, delta_ms, ok=True, cancelled=False, prompt_tokens=10, error=None):
    n = len(delta_ms)
    return {"start": T0 + start, "ok": ok, "cancelled": cancelled, "error": error,
            "ttft_ms": delta_ms[0] if delta_ms else None, "e2e_ms": (delta_ms[-1] if delta_ms else 0) + 1.0,
            "tpot_ms": (delta_ms[-1] - delta_ms[0]) / (n - 1) if n > 1 else None,
            "output_tokens": n, "server_num_output_tokens": n, "deltas": n, "max_tokens": n,
            "prompt_tokens": prompt_tokens, "delta_ms": delta_ms}


def test_percentiles_match_numpy():
    xs = list(np.random.default_rng(0).exponential(10, 1001))
    got = percentiles(xs)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(np.percentile(xs, q))
    assert got["count"] == 1001 and percentiles([]) == {"count": 0}


def test_summarize_counts_the_window_only():
    marks = {"start": T0, "stopping": T0 + 10.0}
    records = [
        rec(0.0, [100.0, 200.0, 300.0]),            # inside
        rec(9.5, [100.0, 400.0, 600.0, 900.0]),     # 2 tokens inside, then finishes in the stop phase
        rec(9.0, [500.0], ok=False, cancelled=True),  # cancelled at stop: its token still counts
        rec(1.0, [], ok=False, error="ServerError: UNAVAILABLE"),
    ]
    s = summarize(records, marks, concurrency=2)
    assert s["window_s"] == pytest.approx(10.0)
    assert (s["requests"], s["errors"], s["cancelled"]) == (2, 1, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["output_tok_per_s"] == pytest.approx((3 + 2 + 1) / 10.0)
    assert s["request_per_s"] == pytest.approx(1 / 10.0)  # only the first completed inside
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 5 and s["itl_ms"]["p50"] == pytest.approx(200.0)
    assert s["output_tokens"] == 7
    assert s["error_samples"] == ["ServerError: UNAVAILABLE"]


def test_warmup_leaves_the_first_seconds_out():
    """Window [start + 2 s, stopping]: tokens and completions before it are not counted, and a request
    sent during the warm-up is not in the latency percentiles even when it ends inside the window."""
    marks = {"start": T0, "stopping": T0 + 10.0}
    records = [
        rec(0.0, [500.0, 1500.0, 2500.0, 3500.0]),  # sent in the warm-up: its last 2 tokens and its end count
        rec(3.0, [100.0, 200.0]),                   # inside
        rec(9.5, [300.0, 800.0]),                   # 1 token inside, ends after the stop
        rec(1.0, [200.0], ok=False, cancelled=True),  # its one token came in the warm-up
    ]
    s = summarize(records, marks, concurrency=2, warmup_s=2.0)
    assert s["window_s"] == pytest.approx(8.0) and s["warmup_s"] == 2.0
    assert s["output_tok_per_s"] == pytest.approx((2 + 2 + 1) / 8.0)
    assert s["request_per_s"] == pytest.approx(2 / 8.0)
    assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["p50"] == pytest.approx(200.0)  # 100 and 300, not 500
    assert s["e2e_ms"]["count"] == 2 and s["itl_ms"]["count"] == 2
    assert s["requests"] == 3  # counts still cover every request
    unwarmed = summarize(records, marks, concurrency=2)
    assert unwarmed["output_tok_per_s"] == pytest.approx((4 + 2 + 1 + 1) / 10.0) and unwarmed["ttft_ms"]["count"] == 3


def test_read_records_skips_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [{"kind": "start", "t": 1.0}, {"kind": "request", **rec(0.0, [1.0])}, {"kind": "stopping", "t": 5.0}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "requ')
    requests, marks = read_records(path)
    assert len(requests) == 1 and marks == {"start": 1.0, "stopping": 5.0}
    assert read_records(tmp_path / "missing.jsonl") == ([], {})


def test_cli_values():
    assert parse_seconds("60s") == 60 and parse_seconds("2m") == 120 and parse_seconds("1m30s") == 90
    assert parse_seconds("2.5") == 2.5
    assert parse_levels("1,2, 4") == [1, 2, 4]
    for bad in ("", "x", "-1s"):
        with pytest.raises(Exception):  # noqa: B017 - argparse's type error
            parse_seconds(bad)
    with pytest.raises(Exception):  # noqa: B017
        parse_levels("0,1")


PROM = """\
# TYPE deepseek:prefix_cache_queries_total counter
deepseek:prefix_cache_queries_total{model="deepseek_v4",version="1"} 1000
deepseek:prefix_cache_hit_tokens_total{model="deepseek_v4",version="1"} 600
deepseek:generation_tokens_total{model="deepseek_v4",version="1"} 50
deepseek:request_success_total{finished_reason="length",model="deepseek_v4",version="1"} 7
deepseek:request_success_total{finished_reason="abort",model="deepseek_v4",version="1"} 1
deepseek:time_to_first_token_seconds_sum{model="deepseek_v4",version="1"} 1.5
nv_inference_request_failure{model="deepseek_v4",reason="OTHER",version="1"} 0
deepseek:stream_deltas_total{model="deepseek_v4",version="1"} 1000
deepseek:stream_responses_total{model="deepseek_v4",version="1"} 500
"""


def test_metrics_parse_and_delta():
    before = scrape.parse(PROM)
    assert before["requests_finished"] == 8 and before["requests_finished/length"] == 7
    assert "time_to_first_token_seconds_sum" not in before
    after = scrape.parse(PROM.replace(" 1000", " 1400").replace(" 600", " 900").replace("} 7", "} 12"))
    d = scrape.delta(before, after)
    assert d["prefix_cache_queries"] == 400 and d["prefix_hit_ratio"] == pytest.approx(0.75)
    assert d["stream_deltas"] == 400 and d["deltas_per_response"] is None  # no new response in the window
    assert d["requests_finished/length"] == 5
    assert scrape.delta(before, None) is None
    assert scrape.delta(before, before)["prefix_hit_ratio"] is None  # no lookups: no ratio
    assert scrape.scrape(None) is None and scrape.scrape("http://127.0.0.1:9/metrics", timeout_s=1) is None


def test_speculative_decoding_acceptance_over_a_level():
    spec = ('deepseek:spec_decode_num_drafts_total{{model="m",version="1"}} {}\n'
            'deepseek:spec_decode_num_draft_tokens_total{{model="m",version="1"}} {}\n'
            'deepseek:spec_decode_num_accepted_tokens_total{{model="m",version="1"}} {}\n')
    before, after = scrape.parse(PROM + spec.format(10, 30, 12)), scrape.parse(PROM + spec.format(30, 90, 48))
    d = scrape.delta(before, after)
    assert (d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"], d["spec_decode_num_accepted_tokens"]) \
        == (20, 60, 36)
    assert d["spec_acceptance_rate"] == pytest.approx(0.6) and d["spec_mean_acceptance_length"] == pytest.approx(2.8)
    assert scrape.delta(before, before)["spec_acceptance_rate"] is None


def sweep_result(label, scale):
    levels = []
    for c in (1, 2, 4):
        s = summarize([rec(0.1 * i, [50.0 * scale, 60.0 * scale, 75.0 * scale]) for i in range(5 * c)],
                      {"start": T0, "stopping": T0 + 5}, c)
        levels.append({**s, "server": {"prefix_hit_ratio": 0.5}, "driver": {"killed": False}})
    return {"label": label, "command": f"python -m loadtest.sweep --label {label}", "protocol": "grpc",
            "driver": "locust", "workload": {"kind": "agentic", "system_len": 64, "turn_len": "16", "turns": 3,
                                              "output_len": "3", "input_len": "8", "prompts_file": ""},
            "sampling": {"temperature": 0.0, "ignore_eos": True}, "duration_s": 5.0,
            "server": {"url": "127.0.0.1:1", "serve": True, "engine_args": {"enable_prefix_caching": scale < 1}},
            "host": {"platform": "test", "cpus": 2}, "started": "now", "levels": levels}


def test_report_tables_and_plots(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(sweep_result("on", 0.5)))
    b.write_text(json.dumps(sweep_result("off", 1.0)))
    pytest.importorskip("matplotlib")
    assert report.main([str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| concurrency | on | off | off / on |" in md
    assert "| 1 | 25.0 | 50.0 | 2.00x |" in md  # TTFT p50: 50 ms * scale
    assert "`python -m loadtest.sweep --label on`" in md and '{"enable_prefix_caching": true}' in md
    for name in ("throughput", "ttft", "itl", "e2e"):
        png = tmp_path / "rep" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name}.png)" in md
    assert report.main([str(a), str(a), "--out", str(tmp_path / "x")]) == 1  # two sweeps, one label


def test_report_marks_client_bound_levels(tmp_path):
    sweep = sweep_result("one", 1.0)
    sweep["levels"][2].update(client_bound=True, saturation={
        "reasons": ["a client process used 0.97 of a core"],
        "client_cpu": {"busiest_cores": 0.97}, "littles_law": {"busy_ratio": 0.4}})
    md = report.markdown([sweep])
    assert "| 4 | 50.0 (client-bound) |" in md and "| 2 | 50.0 |" in md  # TTFT p50: only c=4 is marked
    assert "| 4 | 40.0 (client-bound) |" in md  # users busy, %
    assert "- one c=4: client-bound (a client process used 0.97 of a core)" in md
    pytest.importorskip("matplotlib")
    assert report.main([str(_write(tmp_path / "one.json", sweep)), "--out", str(tmp_path / "rep")]) == 0


def _write(path, data):
    path.write_text(json.dumps(data))
    return path
