"""tools/bench_moe_prefill.py: the dispatch rule it fits from its rows, and its CPU run (Triton's interpreter)
on a tiny expert shape writing the rows and the rule."""

import json

import pytest

from tools import bench_moe_prefill


def _row(experts, rpe, fused, grouped):
    return {"experts": experts, "rows_per_expert": rpe, "fused_us": fused, "grouped_us": grouped}


def test_rule_is_where_grouped_wins_from_there_on_per_expert_count():
    rows = [_row(16, 64, 10, 12), _row(16, 128, 10, 9), _row(16, 256, 20, 15),
            _row(64, 64, 10, 9), _row(64, 128, 10, 11), _row(64, 256, 20, 15), _row(64, 512, 40, 20),  # a dip
            _row(256, 64, 10, 30), _row(256, 512, 40, 50)]  # never
    assert bench_moe_prefill.fit_rule(rows) == {16: 128, 64: 256, 256: None}


def test_tokens_give_the_rows_per_expert_asked():
    assert bench_moe_prefill.tokens_for(512, 256, 6) * 6 >= 512 * 256 > (bench_moe_prefill.tokens_for(512, 256, 6) - 1) * 6
    assert bench_moe_prefill.tokens_for(16, 16, 6) == 43


def test_cpu_run_checks_both_paths_and_writes_rows_and_rule(tmp_path):
    out = tmp_path / "moe.json"
    assert bench_moe_prefill.main(["--dims", "128,128", "--experts", "2", "--topk", "2", "--rows-per-expert", "2",
                                   "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["tokens"] == 2 and row["rows_per_expert"] == 2 and row["fused_rel_err"] <= 2e-2
    assert set(result["rule"]) == {"2"}


def test_extra_tiles_are_checked_and_timed_beside_the_table_s(tmp_path):
    """--tiles: each fused tile run at every size against the reference (the frag decode on a K that allows it, the
    tile's own BLOCK_M); a malformed tile is refused before any work."""
    assert bench_moe_prefill.parse_tile("128x64x128w8s3:bf16-frag")["down"] == {
        "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "MX": "bf16-frag"}
    with pytest.raises(SystemExit):
        bench_moe_prefill.main(["--tiles", "128x64w8"])
    out = tmp_path / "moe.json"
    assert bench_moe_prefill.main(["--dims", "128,128", "--experts", "2", "--topk", "2", "--rows-per-expert", "2",
                                   "--tiles", "32x32x128w4s2:bf16-frag,16x32x64w4s2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["tiles"]) == {"32x32x128w4s2:bf16-frag", "16x32x64w4s2"}
    assert all(t["rel_err"] <= 2e-2 and t["us"] > 0 for t in row["tiles"].values())
