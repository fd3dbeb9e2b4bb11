"""tools/bench_fused.py's CPU-runnable parts: the table (ratio to floor and to the old path, errors
kept) and the refusal without a GPU. Its check runs the kernels on the GPU (tools/h200_bench.sh fused);
the same kernels run here under the interpreter in tests/kernels."""

import sys

from tools import bench_fused as bf


def test_table_shows_floor_and_old_path_ratios_and_errors():
    rows = [bf._row("moe mxfp4", "E16", 150, "16-row tiles (old)", 4e-3, 1e-3),
            bf._row("moe mxfp4", "E16", 150, "row tile per step", 1e-3, 1e-3, 4e-3),
            bf._row("mega-gate", "E256", 1, "one launch", None, None, error="CompilationError: boom")]
    assert rows[1]["vs_old"] == 4.0 and rows[0]["vs_old"] is None
    lines = bf.table(rows).splitlines()
    assert len(lines) == 4
    assert "25%" in lines[1] and "100%" in lines[2] and "4.00" in lines[2]
    assert "boom" in lines[3]


def test_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(bf.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_fused"])
    assert bf.main() == 2
    assert "needs a CUDA device" in capsys.readouterr().err
