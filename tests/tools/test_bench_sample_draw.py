"""tools/bench_sample_draw.py on the CPU (Triton's interpreter, the search's small sizes): every option's row reports
the kernel drawing the reference's tokens from the reference's kept sets."""

from tools import bench_sample_draw


def test_the_tool_checks_every_option(tmp_path):
    rows = bench_sample_draw.main(["--small", "--batches", "3", "--vocab", "257", "--sweep",
                                   "--json", str(tmp_path / "d.json")])
    assert [r["options"] for r in rows[:5]] == list(bench_sample_draw.OPTIONS) and len(rows) == 5 + 2
    assert all(r["same_token"] == 1.0 and r.get("same_cut", 1.0) == 1.0 for r in rows), rows
    assert (tmp_path / "d.json").exists()
