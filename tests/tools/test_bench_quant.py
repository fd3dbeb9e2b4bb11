"""tools/bench_quant.py's CPU-runnable parts: the timed shapes, the floor arithmetic, the crossover,
the table, and its correctness check itself (under the Triton interpreter, on the CPU)."""

import torch

from tools import bench_quant as bq


def test_cases_cover_decode_and_prefill_for_every_op():
    cases = bq.cases()
    lin = [c for c in cases if c["op"] == "fp8_linear"]
    assert {c["rows"] for c in lin} == {1, 32, 150, 2048, 8192}
    assert {c["variant"] for c in lin} == {"dequant", "mma"}
    assert len(lin) == len(bq.LINEAR_SHAPES) * 5 * 2
    moe = [c for c in cases if c["op"] == "moe"]
    assert {c["rows"] for c in moe if c["fmt"] == "mxfp4"} == {1, 32, 150, 2048, 8192}
    assert {c["rows"] for c in moe if c["fmt"] == "fp8"} == {1, 32, 150}
    assert all(c["E"] == 256 and c["k"] == 6 for c in moe)
    assert len(bq.cases(quick=True)) < len(cases)


def test_linear_floor_is_memory_at_decode_and_flops_at_prefill():
    n, k = 4096, 4096
    dec = bq.linear_floor(1, n, k, "dequant")
    assert dec["bytes"] == n * k + 32 * 32 * 4 + 2 * k + 2 * n
    assert dec["floor_s"] == dec["mem_s"] == dec["bytes"] / 4.2e12
    pre = bq.linear_floor(8192, n, k, "mma")
    assert pre["flops"] == 2 * 8192 * n * k and pre["floor_s"] == pre["flop_s"] == pre["flops"] / 1580e12
    assert bq.linear_floor(8192, n, k, "dequant")["flop_s"] == 2 * pre["flop_s"]  # bf16 MMA: half the FP8 peak


def test_moe_floor_counts_the_experts_hit_as_stored():
    D, I = 4096, 2048
    one = bq.moe_floor(1, 6, D, I, 6, "mxfp4")
    assert bq.expert_bytes(D, I, "mxfp4") == 3 * I * D * (0.5 + 1 / 32)
    assert one["bytes"] == 6 * 3 * I * D * (0.5 + 1 / 32) + 4 * D + 24 * I * 1
    assert one["floor_s"] == one["mem_s"]
    assert bq.moe_floor(1, 6, D, I, 6, "fp8")["bytes"] > 1.8 * one["bytes"]  # FP8 experts: ~2x the bytes


def test_crossover_and_table():
    res = []
    for m, td, tm in ((1, 1.0, 2.0), (32, 1.0, 1.5), (150, 2.0, 1.0)):
        for v, t in (("dequant", td), ("mma", tm)):
            res.append({"op": "fp8_linear", "name": "wq_a", "rows": m, "n": 8, "k": 16, "variant": v, "seconds": t * 1e-6,
                        "floor": bq.linear_floor(m, 8, 16, v)})
    res.append({"op": "moe", "name": "experts", "rows": 1, "fmt": "mxfp4", "D": 64, "I": 32, "E": 4, "k": 2,
                "error": "RuntimeError: boom"})
    assert bq.crossover(res) == {"8x16": 32}
    text = bq.table(res)
    assert len(text.splitlines()) == 1 + len(res) and "boom" in text.splitlines()[-1]


def test_check_passes_on_the_kernels_under_the_interpreter():
    assert bq.check(torch.device("cpu")) == []
