"""tools/bench_quant.py's CPU-runnable parts: the swept shapes and candidates, the floor arithmetic,
the crossover and winners' table, a sweep that survives failing candidates, and its correctness
check itself (under the Triton interpreter, on the CPU)."""

import torch

from tools import bench_quant as bq


def test_cases_cover_decode_and_prefill_for_every_op():
    cases = bq.cases()
    lin = [c for c in cases if c["op"] == "fp8_linear"]
    assert {c["rows"] for c in lin} == {1, 32, 150, 2048, 8192}
    assert len(lin) == len(bq.LINEAR_SHAPES) * 5
    moe = [c for c in cases if c["op"] == "moe"]
    assert {c["rows"] for c in moe if c["fmt"] == "mxfp4"} == {1, 32, 150, 2048, 8192}
    assert {c["rows"] for c in moe if c["fmt"] == "fp8"} == {1, 32, 150}
    assert all(c["E"] == 256 and c["k"] == 6 for c in moe if c["name"] == "experts")
    depth = [(c["fmt"], c["rows"]) for c in moe if c["name"] == "depth"]  # the depth-43 checkpoint's 16 experts
    assert sorted(depth) == sorted((f, m) for f in ("mxfp4", "fp8") for m in (1, 32, 150))
    assert all(c["name"] == "depth" for c in cases[:6]), "the depth MoE rows are swept first"
    assert max(c["rows"] for c in cases[:len(lin) // 5 * 3]) <= 150, "decode shapes are swept first"
    assert len(bq.cases(quick=True)) < len(cases)


def test_candidates_fit_the_kernels_constraints():
    for m in (1, 32, 150, 8192):
        cands = bq.linear_candidates(m)
        assert {c["variant"] for c in cands} == ({"dequant", "mma"} if m <= 150 else {"mma"})
        assert all(128 % c["BLOCK_K"] == 0 for c in cands if c["variant"] == "dequant")  # inside a scale block
        assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    for fmt in ("mxfp4", "fp8"):
        for m in (1, 150, 8192):
            for experts in (16, 256):
                cands = bq.moe_candidates(m, fmt, experts)
                for c in cands:
                    k = c["gate_up"]["BLOCK_K"]
                    assert (128 % k == 0) if fmt == "fp8" else (k % 32 == 0)
                    assert c["gate_up"]["BLOCK_M"] == c["down"]["BLOCK_M"]  # one alignment serves both
                if m == 150 and experts == 16:  # the per-step tile, the old 16-row one, and (MXFP4) the bf16 decode's between
                    assert {c["gate_up"]["BLOCK_M"] for c in cands} == ({16, 32, 64, 128} if fmt == "mxfp4" else {128, 16})
                if m <= 150:  # split-K on and off, register-bounded accumulators
                    assert any(c["gate_up"].get("SPLIT_K") == 1 for c in cands)
                    assert all(c["gate_up"]["BLOCK_M"] * c["gate_up"]["BLOCK_N"] * 2 <= 128 * 32 * c["gate_up"]["num_warps"]
                               for c in cands if c["gate_up"].get("MX") == "bf16")


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


def test_crossover_best_table_and_table():
    res = []
    for m, td, tm in ((1, 1.0, 2.0), (32, 1.0, 1.5), (150, 2.0, 1.0)):
        best = {"variant": "dequant" if td <= tm else "mma", "BLOCK_M": 16, "BLOCK_N": 64}
        res.append({"op": "fp8_linear", "name": "wq_a", "rows": m, "n": 8, "k": 16, "by_variant": {"dequant": td * 1e-6, "mma": tm * 1e-6},
                    "best": best, "seconds": min(td, tm) * 1e-6, "floor": bq.linear_floor(m, 8, 16, "mma"),
                    "candidates": [{"config": best, "seconds": 1e-6}, {"config": best, "error": "x"}]})
    res.append({"op": "moe", "name": "experts", "rows": 1, "fmt": "mxfp4", "D": 64, "I": 32, "E": 4, "k": 2,
                "error": "RuntimeError: boom"})
    assert bq.crossover(res) == {"8x16": 32}
    assert bq.best_table(res)["fp8_linear"]["8x16"][150]["variant"] == "mma"
    text = bq.table(res)
    assert len(text.splitlines()) == 1 + len(res) and "boom" in text.splitlines()[-1]
    assert "1/2" in text.splitlines()[1]


def test_sweep_reports_failing_candidates_and_goes_on():
    want = torch.ones(4)

    def run(cfg):
        if cfg["id"] == 0:
            raise RuntimeError("does not compile")
        return want * (1.5 if cfg["id"] == 1 else float("nan"))

    out = bq._sweep({"op": "moe"}, [{"id": 0}, {"id": 1}, {"id": 2}, {"id": 3}], run, want, lambda cfg: 1e-2,
                    lambda cfg: [], deadline=float("inf"))
    errors = [c["error"] for c in out["candidates"]]
    assert errors[0].startswith("RuntimeError: does not compile") and errors[1].startswith("mismatch")
    assert errors[2].startswith("mismatch") and "best" not in out and "does not compile" in out["error"]
    late = bq._sweep({"op": "moe"}, [{"id": 1}], run, want, lambda cfg: 1e-2, lambda cfg: [], deadline=0.0)
    assert late["candidates"][0]["error"].startswith("skipped")


def test_check_passes_on_the_kernels_under_the_interpreter():
    assert bq.check(torch.device("cpu")) == []


def test_v41_cases_sweep_its_linears_in_32x32_tiles():
    cases = bq.cases(v41=True)
    assert {c["block"] for c in cases} == {32} and {(c["n"], c["k"]) for c in cases} == set(bq.V41_LINEAR_SHAPES.values())
    assert bq.linear_floor(1, 64, 64, "mma", block=32)["bytes"] - bq.linear_floor(1, 64, 64, "mma")["bytes"] == 3 * 4
