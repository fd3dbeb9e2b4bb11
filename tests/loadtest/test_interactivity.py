"""The throughput-vs-interactivity curve: its points from a sweep, interpolation at a fixed tok/s
per user, the optimized / baseline ratio (and the baseline-never-reaches-it rule), the GPU count
read from Triton's metrics, and the report's table and plot."""

import json

import pytest

from loadtest import interactivity, report, scrape
from loadtest.sweep import summarize
from tests.loadtest.test_results import T0, rec, sweep_result


def level(c, tpot_ms, tok_per_s):
    return {"concurrency": c, "tpot_ms": {"mean": tpot_ms}, "output_tok_per_s": tok_per_s}


def sweep(label, points, gpus=1):
    return {"label": label, "gpus": gpus, "levels": [level(*p) for p in points]}


def test_points_are_one_per_level_divided_by_gpus():
    s = sweep("a", [(1, 4.0, 250.0), (8, 5.0, 1600.0), (32, 10.0, 3200.0)], gpus=2)
    s["levels"].append({**level(64, 20.0, 100.0), "failure": "no request completed"})
    assert interactivity.curve(s) == [
        {"concurrency": 1, "tok_per_s_per_user": 250.0, "output_tok_per_s_per_gpu": 125.0},
        {"concurrency": 8, "tok_per_s_per_user": 200.0, "output_tok_per_s_per_gpu": 800.0},
        {"concurrency": 32, "tok_per_s_per_user": 100.0, "output_tok_per_s_per_gpu": 1600.0}]
    # summarize's TPOT mean is what the x axis reads: 3 tokens 10 ms apart -> 100 tok/s per user
    lv = summarize([rec(0.0, [50.0, 60.0, 70.0]), rec(0.1, [50.0, 70.0, 90.0])], {"start": T0, "stopping": T0 + 5}, 2)
    assert interactivity.tok_per_s_per_user(lv) == pytest.approx(1000 / 15.0)


def test_interpolation_and_the_ratio_at_a_fixed_interactivity():
    pts = interactivity.curve(sweep("a", [(1, 4.0, 250.0), (8, 5.0, 1600.0), (32, 10.0, 3200.0)]))
    # (200 tok/s per user, 1600 tok/s) and (100, 3200) around 150
    assert interactivity.at(pts, 150.0) == pytest.approx(2400.0)
    assert interactivity.at(pts, 200.0) == pytest.approx(1600.0)
    assert interactivity.at(pts, 300.0) is None and interactivity.at(pts, 50.0) is None
    opt = sweep("opt", [(1, 2.0, 500.0), (32, 5.0, 6400.0), (150, 8.0, 12000.0)])
    base = sweep("base", [(1, 4.0, 250.0), (8, 5.0, 1600.0), (32, 10.0, 3200.0)])
    r = interactivity.compare(opt, base, 150.0)
    want_opt = 6400 + (12000 - 6400) * (150 - 200) / (125 - 200)
    assert r["optimized"]["output_tok_per_s_per_gpu"] == pytest.approx(want_opt)
    assert r["ratio"] == pytest.approx(want_opt / 2400.0) and r["note"] is None
    assert "150.0 tok/s per user" in interactivity.describe(r) and "x" in interactivity.describe(r)
    # a baseline that never gets to 300 tok/s per user: compared at its best (250) instead
    r = interactivity.compare(opt, base, 300.0)
    assert r["at_tok_per_s_per_user"] == 250.0 and "never reaches 300" in r["note"]
    assert r["baseline"]["output_tok_per_s_per_gpu"] == 250.0 and r["ratio"] == pytest.approx(
        (500 + (6400 - 500) * (250 - 500) / (200 - 500)) / 250.0)
    # a baseline far slower than every optimized level (1 tok/s per user): the optimized sweep's best
    # throughput among its levels, all more interactive, taken as a lower bound
    slow = sweep("slow", [(1, 1000.0, 1.0), (32, 2000.0, 16.0)])
    r = interactivity.compare(opt, slow, 150.0)
    assert r["at_tok_per_s_per_user"] == 1.0 and r["optimized"]["output_tok_per_s_per_gpu"] == 12000.0
    assert r["ratio"] == pytest.approx(12000.0) and "lower bound" in r["note"] and "c=150" in r["note"]
    # an optimized sweep entirely below the point compared at still gives no ratio
    r = interactivity.compare(slow, opt, 150.0)
    assert r["ratio"] is None and "does not cover" in r["note"]


def test_cli_writes_the_comparison(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "cmp.json"
    a.write_text(json.dumps(sweep("opt", [(1, 2.0, 500.0), (32, 5.0, 6400.0), (150, 8.0, 12000.0)], gpus=4)))
    b.write_text(json.dumps(sweep("base", [(1, 4.0, 250.0), (32, 10.0, 3200.0)], gpus=4)))
    assert interactivity.main([str(a), str(b), "--at", "150", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # per GPU: opt (200, 1600) .. (125, 3000); base (250, 62.5) .. (100, 800)
    assert result["ratio"] == pytest.approx((1600 + 1400 * 50 / 75) / (62.5 + 737.5 * 100 / 150))
    assert "opt (4 GPU)" in capsys.readouterr().out
    assert interactivity.main([str(a), str(tmp_path / "missing.json")]) == 1


def test_gpu_count_from_tritons_metrics():
    text = ('nv_gpu_utilization{gpu_uuid="GPU-a"} 0.5\nnv_gpu_utilization{gpu_uuid="GPU-b"} 0.1\n'
            'nv_gpu_memory_used_bytes{gpu_uuid="GPU-c"} 1\nnv_inference_count{model="m"} 3\n')
    assert scrape.gpu_count(text) == 2 and scrape.gpu_count("nv_inference_count 1\n") is None


def test_report_has_the_curve_and_the_ratio_at_150(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    slow, fast = sweep_result("base", 1.0), sweep_result("opt", 0.1)  # TPOT 12.5 ms vs 1.25 ms
    for s in (slow, fast):
        s["gpus"] = 1
        for lv in s["levels"]:
            lv["output_tok_per_s_per_gpu"] = lv["output_tok_per_s"]
    a.write_text(json.dumps(slow))
    b.write_text(json.dumps(fast))
    md = report.markdown([slow, fast], at=80.0)
    assert "### Tokens/s per user (1000 / mean TPOT)" in md
    assert "| 1 | 80.0 | 800.0 | 10.00x |" in md
    assert "### At 80 tok/s per user" in md and "never reaches" not in md
    pytest.importorskip("matplotlib")
    assert report.main([str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "interactivity.png").read_bytes()[:4] == b"\x89PNG"
