"""The teacher-forced check (tools/check_teacher_forced.py) on the tiny checkpoints, on the CPU: the engine
under test decodes on the decode graphs' static batches, so a broken decode path or one wrong layer
must show, and the per-layer probe must name the layer. V4's reference is checked against transformers too.
The noise floor (tools/teacher_forced_floor.py) must hold an engine that only sums in another order and not a
planted bug."""

import json
import math
import sys

import pytest

from tools.bench_engine import random_prompts
from tools.check_teacher_forced import (
    build_engines,
    build_reference,
    check,
    main,
    perturb_layer,
    switch_verdicts,
)
from tools.teacher_forced_floor import floor_verdict, noise_floor


@pytest.fixture(scope="module")
def v41_tiny(tmp_path_factory):
    from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint

    return str(write_v41_checkpoint(tmp_path_factory.mktemp("v41") / "tiny", "v41-tiny"))


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_float32_engine_matches_the_reference_and_a_perturbed_layer_is_named(family, request):
    model = request.getfixturevalue("v41_tiny") if family == "v41" else ""
    steps, lens = 6, (17, 26)
    # V4.1's decoder trim approximates (engine.replay_error measures it): off, float32 matches float32
    ref, test = build_engines(model, len(lens), max(lens) + steps + 1, {"dtype": "float32", "swa_decoder_trim": False})
    prompts = [p[:n] for p, n in zip(random_prompts(len(lens), max(lens), ref.cfg.vocab_size, seed=3), lens)]

    clean, _ = check(ref, test, prompts, steps, probes=1, oracle=family == "v4")
    assert test.runner.replays > 0 and ref.runner.replays == 0  # the engine decoded on its static batches
    assert clean["positions"] == len(lens) * steps and clean["top1_agreement"] == 1.0
    # float32 against float32, the engine's decode steps against the reference's prefill: rounding
    # only (V4.1 here reaches a KL of 1.4e-6; a planted error below is above 1e-3)
    assert clean["max_kl"] < 1e-5 and clean["probes"][0]["jump_added"] < 1e-4
    assert clean["probes"][0]["route_flips"] == []
    if family == "v4":  # the reference itself against transformers on the same tokens
        assert clean["oracle"]["top1_agreement"] == 1.0 and clean["oracle"]["max_kl"] < 1e-6

    perturb_layer(test, 1, 1.5)
    for teacher in ("engine", "reference"):  # the reference's own decode steps, its tokens forced on the engine
        bad, _ = check(ref, test, prompts, steps, probes=1, teacher=teacher)
        assert bad["mean_kl"] > 1e-3
        (probe,) = bad["probes"]
        assert probe["jump"] == 1 and probe["layers"][0] < 1e-5 < 1e-1 < probe["layers"][1]
    if family == "v4":  # the rounded reference (bf16 where the kernels store) still names the planted layer
        rounded = build_reference(model, len(lens), max(lens) + steps + 1, {"dtype": "float32"}, "rounded")
        bad, _ = check(rounded, test, prompts, steps, probes=1)
        (probe,) = bad["probes"]
        assert bad["reference"] == "rounded" and rounded.runner.replays == 0
        assert probe["jump"] == 1 and probe["layers"][0] < 2e-2 < 1e-1 < probe["layers"][1]


def test_switch_verdicts_smoke():
    """The switches' table on the CPU, where the engine serves the references (no switch changes them): PDL
    identical, a fusion rounding, every row against the same reference logits."""
    steps, lens = 2, (9, 14)
    ref, test = build_engines("", len(lens), max(lens) + steps + 1, {}, "rounded")
    prompts = [p[:n] for p, n in zip(random_prompts(len(lens), max(lens), ref.cfg.vocab_size, seed=1), lens)]
    rows = switch_verdicts(ref, test, prompts, steps, ["pdl", "mega_mhc", "moe_gemv", "no_attn_offsets"])
    assert [r["switch"] for r in rows] == ["base", "pdl", "mega_mhc", "moe_gemv", "no_attn_offsets"]
    assert [r["verdict"] for r in rows] == ["-", "identical", "rounding", "rounding", "rounding"]
    assert rows[2]["mean_kl"] == rows[0]["mean_kl"] and rows[0]["positions"] == len(lens) * steps


def test_a_switch_is_a_fusion_or_a_kernel_variant_alone():
    """--switches names: a kernel variant goes on over the default ones, no_ and a default one goes off, a fusion
    alone with the default variants; the base path ends with the defaults again; an unknown name is refused."""
    from kernels import fusions, variants
    from tools.check_teacher_forced import switch_names, switched

    _, test = build_engines("", 1, 16, {}, "rounded")
    seen = {}
    for name in ["fp8_cublas_mid", "no_attn_offsets", "mega_mhc", "base"]:
        switched(test, name)
        seen[name] = (variants.enabled(), fusions.enabled())
    default = tuple(v for v in variants.ALL if v in variants.DEFAULT)
    assert seen["fp8_cublas_mid"] == (tuple(v for v in variants.ALL if v in {*default, "fp8_cublas_mid"}), ())
    assert seen["no_attn_offsets"] == (tuple(v for v in default if v != "attn_offsets"), ())
    assert seen["mega_mhc"] == (default, ("mega_mhc",)) and seen["base"] == (default, ())
    assert switch_names("pdl,fp8_cublas_mid,no_bf16_gemv") == ["pdl", "fp8_cublas_mid", "no_bf16_gemv"]
    with pytest.raises(ValueError, match="unknown switches"):
        switch_names("no_fp8_cublas_mid")  # fp8_cublas_mid is not on by default: nothing to turn off


def test_noise_floor_holds_an_engine_that_only_sums_in_another_order_and_not_a_planted_bug():
    """The floor's pairs on the CPU, where the engine serves the references' ops: an engine that differs from the
    rounded reference only in summation order (it serves the reordered references) scores exactly floor pair 2
    (the same predictions on the same tokens: at the floor), a planted bug lands orders of magnitude above it."""
    steps, lens = 6, (17, 26)
    max_len = max(lens) + steps + 1
    engine_args = {"dtype": "float32", "kernels": "reordered"}
    ref, test = build_engines("", len(lens), max_len, engine_args, "rounded")
    prompts = [p[:n] for p, n in zip(random_prompts(len(lens), max(lens), ref.cfg.vocab_size, seed=3), lens)]
    clean, fed = check(ref, test, prompts, steps, probes=1)
    pairs = noise_floor(fed, ref, lambda kind: build_reference("", len(lens), max_len, engine_args, kind), probes=1)

    assert [p["pair"] for p in pairs] == ["float32 vs rounded", "rounded vs reordered"]
    for p in pairs:
        figures = [p["top1_agreement"], p["mean_kl"], p["max_kl"], p["max_logit_diff"], *p["probes"][0]["layers"]]
        assert p["positions"] == len(lens) * steps and all(math.isfinite(f) for f in figures)
    storage, order = pairs
    # Order alone: the halves' float32 sums differ in their last bits and the bf16 stores absorb nearly all of
    # that; a value at a rounding midpoint flips one bf16 step and grows through the layers, and the logits
    # (never stored) keep the float32 difference: small, never zero. bf16 storage moves far more.
    assert 0 < order["mean_kl"] < storage["mean_kl"] / 10 and order["max_logit_diff"] > 0
    judged = floor_verdict(clean, pairs)
    assert judged["at_floor"] and judged["ratio"] == pytest.approx(1.0, rel=1e-3)
    assert judged["verdict"].startswith("at the noise floor")

    perturb_layer(test, 1, 1.5)
    bad, _ = check(ref, test, prompts, steps, probes=1)
    judged = floor_verdict(bad, pairs)
    assert not judged["at_floor"] and judged["ratio"] > 100 and bad["probes"][0]["jump"] == 1
    assert judged["verdict"].startswith("above the floor") and "jump layer (1)" in judged["verdict"]


def test_floor_option_writes_the_pairs_and_the_verdict(tmp_path, monkeypatch):
    """--floor through the command line: the pairs and the verdict in the JSON, the targets as before."""
    out = tmp_path / "floor.json"
    monkeypatch.setattr(sys, "argv", ["check_teacher_forced", "--reference", "rounded", "--floor", "--prompts", "2",
                                      "--prompt-len", "9", "--steps", "3", "--probes", "1", "--perturb-layer", "1",
                                      "--json", str(out)])
    assert main() == 0  # the planted layer is named
    report = json.loads(out.read_text())
    floor = report["floor"]
    assert [p["pair"] for p in floor["pairs"]] == ["float32 vs rounded", "rounded vs reordered"]
    assert floor["engine_mean_kl"] == report["references"]["rounded"]["mean_kl"] and not floor["at_floor"]
