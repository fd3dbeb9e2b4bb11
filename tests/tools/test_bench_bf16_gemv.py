"""tools/bench_bf16_gemv.py: V4-Flash's bf16 linear shapes from the preset, and its CPU run (Triton's interpreter) on
a scaled-down shape: both paths timed, the GEMV checked against float64, the rows written."""

import json

from tools import bench_bf16_gemv


def test_shapes_are_v4_flash_s_bf16_linears():
    assert bench_bf16_gemv.v4_flash_shapes() == {"csa_x_readers": (2624, 4096), "hca_x_readers": (1024, 4096),
                                                 "indexer_wq_b": (8192, 1024), "router_gate_e16": (16, 4096),
                                                 "router_gate_e256": (256, 4096)}


def test_cpu_run_checks_the_gemv_and_writes_rows(tmp_path):
    out = tmp_path / "gemv.json"
    assert bench_bf16_gemv.main(["--shapes", "48x256", "--rows", "1,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["k"], r["rows"]) for r in rows] == [(48, 256, 1), (48, 256, 3)]
    assert all(0 <= r["err_over_bound"] <= 1 and r["gemv_us"] > 0 and r["cublas_us"] > 0 for r in rows)
