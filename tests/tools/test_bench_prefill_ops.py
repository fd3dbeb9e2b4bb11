"""tools/bench_prefill_ops.py: its bf16 step count and tile pick, and its CPU run (Triton's interpreter) on small
shapes checking both variants against today's kernels and writing rows, sweeps and picks."""

import json

import torch

from tools import bench_prefill_ops


def test_bf16_steps_counts_last_places_of_the_larger_value():
    a = torch.tensor([1.0, 2.0, -3.0, 0.0]).bfloat16()
    b = a.clone()
    assert bench_prefill_ops.bf16_steps(a, b) == (0, 0.0)
    b[1] = torch.tensor(2.0 + 2.0 ** -6)  # one last place at 2 (8 significant bits)
    assert bench_prefill_ops.bf16_steps(a, b) == (1, 1.0)
    b[2] = torch.tensor(-3.0 - 2 * 2.0 ** -6)
    assert bench_prefill_ops.bf16_steps(a, b) == (2, 2.0)


def test_best_tiles_is_the_least_total_among_candidates_timed_at_every_size():
    row = lambda T, bt, us: {"tokens": T, "kernel": "variant", "block_t": bt, "block_k": 128, "programs": 264,
                             "stages": 3, "warps": 4, **({"us": us} if us is not None else {"error": "smem"})}
    sweep = [row(2048, 64, 10), row(8192, 64, 40), row(2048, 128, 8), row(8192, 128, 45),
             row(2048, 32, 1), row(8192, 32, None)]  # the fastest at 2048 did not launch at 8192
    (best,) = bench_prefill_ops.best_tiles(sweep).values()
    assert best["block_t"] == 64 and best["total_us"] == 50


def test_cpu_run_checks_both_variants_and_writes_rows_sweeps_and_picks(tmp_path):
    out = tmp_path / "ops.json"
    assert bench_prefill_ops.main(["--heads", "2", "--head-dim", "64", "--rope", "16", "--hidden", "32",
                                   "--tokens", "1,5", "--sweep-tokens", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["failures"]
    assert {(r["op"], r["tokens"]) for r in result["rows"]} == {
        (op, T) for T in (1, 5) for op in ("q norm+rope", "kv norm+rope+insert", "q+kv one launch", "inverse rope",
                                           "mix partials", "hc_pre (partials + finish)")}
    mix = [r for r in result["rows"] if r["op"] == "mix partials"]
    assert all(r["today_rel_err"] <= 1e-5 and r["variant_rel_err"] <= 1e-5 for r in mix)
    assert set(result["best"]["rope_rows"]) == {"1", "5"} and set(result["best"]["mix"]) == {"today", "variant"}
