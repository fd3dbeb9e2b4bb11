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
    (at150,) = result["at"]
    # per GPU: opt (200, 1600) .. (125, 3000); base (250, 62.5) .. (100, 800)
    assert at150["ratio"] == pytest.approx((1600 + 1400 * 50 / 75) / (62.5 + 737.5 * 100 / 150))
    assert [c["label"] for c in result["curves"]] == ["opt", "base"]
    assert "opt (4 GPU)" in capsys.readouterr().out
    assert interactivity.main([str(a), str(tmp_path / "missing.json")]) == 1


def test_one_curve_read_at_several_points():
    # per GPU (2 GPUs): (250 tok/s per user, 125) (200, 800) (100, 1600) (40, 1500): past its peak at c=64
    pts = interactivity.curve(sweep("a", [(1, 4.0, 250.0), (8, 5.0, 1600.0), (32, 10.0, 3200.0),
                                          (64, 25.0, 3000.0)], gpus=2))
    inside, level, between, above, below = (interactivity.read(pts, x) for x in (150.0, 200.0, 70.0, 300.0, 20.0))
    assert inside == {"tok_per_s_per_user": 150.0, "output_tok_per_s_per_gpu": pytest.approx(1200.0),
                      "lower_bound": False, "note": None}
    assert level["output_tok_per_s_per_gpu"] == pytest.approx(800.0) and level["note"] is None
    assert between["output_tok_per_s_per_gpu"] == pytest.approx(1600 + (1500 - 1600) * 30 / 60)
    # more interactive than every level: nothing, and the note names the most interactive one
    assert above["output_tok_per_s_per_gpu"] is None and not above["lower_bound"]
    assert "does not cover 300" in above["note"] and "c=1, 250.0" in above["note"]
    # less interactive than every level: the best throughput among them (c=32, not the last level), a lower bound
    assert below["output_tok_per_s_per_gpu"] == pytest.approx(1600.0) and below["lower_bound"]
    assert "c=64, 40.0" in below["note"] and "c=32, 100.0" in below["note"] and "lower bound" in below["note"]
    assert interactivity.describe_reading(below).startswith("at 20 tok/s per user: >= 1,600.0 output tok/s per GPU")
    assert interactivity.read([], 20.0)["note"] == "no level measured"


def test_cli_reads_one_sweep_at_several_points(tmp_path, capsys):
    a, out = tmp_path / "a.json", tmp_path / "read.json"
    a.write_text(json.dumps(sweep("depth", [(1, 12.0, 80.0), (32, 30.0, 1000.0), (64, 60.0, 1100.0)])))
    assert interactivity.main([str(a), "--at", "20,50,100", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    (c,) = result["curves"]
    assert c["label"] == "depth" and [p["concurrency"] for p in c["points"]] == [1, 32, 64]
    at20, at50, at100 = result["at"]
    # (83.3 tok/s per user, 80) (33.3, 1000) (16.7, 1100)
    assert at20["output_tok_per_s_per_gpu"] == pytest.approx(1000 + 100 * (33.333 - 20) / 16.667, rel=1e-3)
    assert at50["output_tok_per_s_per_gpu"] == pytest.approx(80 + 920 * (83.333 - 50) / 50, rel=1e-3)
    assert at100["output_tok_per_s_per_gpu"] is None and "does not cover 100" in at100["note"]
    assert "at 50 tok/s per user: 693.3 output tok/s per GPU" in printed
    for bad in ("0", "20,x", ""):
        with pytest.raises(SystemExit) as stop:
            interactivity.main([str(a), "--at", bad])
        assert stop.value.code == 2


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
