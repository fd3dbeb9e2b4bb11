"""tools/bench_indexer.py: its CPU run (Triton's interpreter) on a scaled-down indexer checks that today's selection
and the indexer_select variant pick the same sets at every row width and context, and writes the rows."""

import json

from tools import bench_indexer


def test_cpu_run_checks_both_paths_and_writes_rows(tmp_path):
    out = tmp_path / "indexer.json"
    assert bench_indexer.main(["--small", "--tokens", "1,3", "--widths", "64,256", "--contexts", "64,512",
                               "--prefill", "96", "--chunk", "32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # contexts past a row's width are skipped (512 positions are 128 entries: not in a 64-entry row); the prefill
    # chunk: the last 32 tokens of 96 positions, rows of 24 entries
    assert [(r["kind"], r["tokens"], r["width"], r["context"]) for r in rows] == [
        ("decode", 1, 64, 64), ("decode", 3, 64, 64), ("decode", 1, 256, 64), ("decode", 1, 256, 512),
        ("decode", 3, 256, 64), ("decode", 3, 256, 512), ("prefill", 32, 24, 96)]
    assert all(r["same_set"] and r["today_us"] > 0 and r["select_us"] > 0 for r in rows)
