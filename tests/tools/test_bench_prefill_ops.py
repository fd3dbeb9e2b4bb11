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


def test_worst_element_tells_a_rounding_from_a_sign_flip():
    """A rounding moves an element by one bf16 last place of itself, or a pair that cancels to near zero by a
    last place of its row (hundreds of its own); a sign flip of a typical element by about twice its size: only
    the flip is more than a rounding, and it is the one named."""
    torch.manual_seed(0)
    today = torch.randn(6, 2, 16).bfloat16()
    today[1, 0, 7] = 1.5  # a large element, one last place (2^-7) off below
    today[4, 1, 2] = 2.0 ** -20  # a pair that cancelled to near zero in one kernel...
    got = today.clone()
    got[1, 0, 7] = 1.5 + 2 ** -7
    got[4, 1, 2] = -(2.0 ** -20)  # ...and to its negative in the other
    rounding = bench_prefill_ops.worst_element(got, today, None)
    assert rounding["rows_differing"] == 2 and rounding["x_rounding"] <= 1.0
    got[2, 1, 5] = -today[2, 1, 5]
    worst = bench_prefill_ops.worst_element(got, today, today.float() * 1.01)
    assert (worst["row"], worst["col"]) == (5, 5) and worst["rows_differing"] == 3 and worst["x_rounding"] > 10
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
    got = bench_prefill_ops.mix_sums(_hc_mix_partials(x, fn))
    got[77, :24] *= 1.1
    d = bench_prefill_ops.diagnose_mix(x, fn, bench_prefill_ops.MixTruth.of(x, fn), got)
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
    assert all(r["worst"]["x_rounding"] <= 1.0 for r in rope)
    assert result["mix_sweep"] and all(r["rel_err"] <= 1e-5 for r in result["mix_sweep"] if "us" in r)
    assert set(result["best"]["rope_rows"]) == {"1", "5"} and set(result["best"]["mix"]) == {"today", "variant"}


def test_an_fma_contracted_differently_is_within_a_rounding_though_hundreds_of_last_places_of_an_element():
    """Why the rope check measures against the row: norm + RoPE on V4-Flash's query shape (64 heads x 512, rope 64,
    bf16 inputs), once with every product rounded and once with one product of each rotation contracted into an
    FMA (one rounding: as a compiler may do in one kernel and not the other). Pairs that cancel exactly on bf16
    values end 0 in one and +-1e-8 in the other: hundreds of last places of the element, nothing of the row."""
    from kernels import reference as ref

    T, heads, dim, rope = 512, 64, 512, 64
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, heads, dim, generator=g).bfloat16().float()
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    cos, sin = ref.rope_cos_sin(torch.randint(0, 8192, (T,), generator=g), inv, torch.bfloat16)
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) / dim + 1e-6)
    ye, yo = y[..., dim - rope::2], y[..., dim - rope + 1::2]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    plain, fused = y.clone(), y.clone()
    plain[..., dim - rope:] = torch.stack([ye * c - yo * s, yo * c + ye * s], -1).flatten(-2)
    fused[..., dim - rope:] = torch.stack([(ye.double() * c - (yo * s).double()).float(),
                                           (yo.double() * c + (ye * s).double()).float()], -1).flatten(-2)
    a, b = plain.bfloat16(), fused.bfloat16()
    differ, steps = bench_prefill_ops.bf16_steps(a, b)
    assert differ > 0 and steps > 100
    assert bench_prefill_ops.worst_element(a, b, None)["x_rounding"] <= 1.0
