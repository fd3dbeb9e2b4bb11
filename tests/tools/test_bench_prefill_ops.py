"""tools/bench_prefill_ops.py: its bf16 step count and tile pick, and its CPU run (Triton's interpreter) on small
shapes checking both variants against today's kernels and writing rows, sweeps and picks."""

import json

import pytest
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
    wrong = [{**row(2048, 16, 2), "rel_err": 0.05}, {**row(8192, 16, 5), "rel_err": 1e-7}]  # fastest, wrong at 2048
    (best,) = bench_prefill_ops.best_tiles(sweep + wrong).values()
    assert best["block_t"] == 64


def test_worst_element_names_a_sign_flip_against_its_rows_scale():
    """A rounding moves an element by a bf16 step of itself; a sign flip by about twice its size: the worst element
    is the flipped one, measured against its row's RMS."""
    torch.manual_seed(0)
    today = torch.randn(6, 2, 16).bfloat16()
    got = today.clone()
    got[0, 0, 3] = torch.tensor(float(today[0, 0, 3]) * (1 + 2 ** -8))  # a rounding
    got[2, 1, 5] = -today[2, 1, 5]
    worst = bench_prefill_ops.worst_element(got, today, today.float() * 1.01)
    assert (worst["row"], worst["col"]) == (5, 5) and worst["rows_differing"] == 2
    assert worst["variant"] == -worst["today"] and worst["reference"] == pytest.approx(worst["today"] * 1.01)
    rms = today.float().reshape(-1, 16)[5].pow(2).mean().sqrt().item()
    assert worst["diff_over_row_rms"] == pytest.approx(2 * abs(worst["today"]) / rms, rel=1e-6)


def test_diagnose_mix_locates_wrong_partials_and_reruns_the_variant_under_other_launches():
    """Planted: one token's mixes off by 10%. The diagnosis names that token and its columns, one token tile, and
    the variant re-run with the decode tiles, one pipeline stage and PDL switched is right (the interpreter)."""
    from kernels.fused_norm_mhc import _hc_mix_partials

    T, D = 300, 40  # the prefill tiles
    torch.manual_seed(1)
    x, fn = torch.randn(T, 4, D).bfloat16(), torch.randn(24, 4 * D) * 0.1
    flat = x.double().reshape(T, -1)
    exact = torch.cat([flat @ fn.double().T, (flat * flat).sum(-1, keepdim=True)], -1)
    size = exact.abs().amax(0)
    got = _hc_mix_partials(x, fn).sum(0)[:, :25].double()
    got[77, :24] *= 1.1
    d = bench_prefill_ops.diagnose_mix(x, fn, exact, size, got)
    assert d["token"] == 77 and d["tokens_wrong"] == 1 and d["token_tiles_wrong"] == 1
    assert d["columns_wrong"] and max(d["columns_wrong"]) < 24
    assert all(d[k] <= bench_prefill_ops.MIX_TOL for k in d if k.startswith("rel_err_"))
    assert {"rel_err_decode_tiles", "rel_err_one_stage"} <= set(d) and any(k.startswith("rel_err_pdl_") for k in d)


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
    rope = [r for r in result["rows"] if "repeatable" in r]
    assert len(rope) == 8 and all(r["repeatable"] == {"today": True, "variant": True} for r in rope)
    assert all(r["worst"]["rows_differing"] == 0 or r["worst"]["diff_over_row_rms"] <= 2 ** -7 for r in rope)
    assert result["mix_sweep"] and all(r["rel_err"] <= 1e-5 for r in result["mix_sweep"] if "us" in r)
    assert set(result["best"]["rope_rows"]) == {"1", "5"} and set(result["best"]["mix"]) == {"today", "variant"}
