"""tools/bench_moe_prefill.py: the dispatch rule it fits from its rows, and its CPU run (Triton's interpreter)
on a tiny expert shape writing the rows and the rule."""

import json

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
