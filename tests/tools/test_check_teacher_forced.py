"""The teacher-forced check (tools/check_teacher_forced.py) on the tiny checkpoints, on the CPU: the engine
under test decodes on the decode graphs' static batches, so a broken decode path or one wrong layer
must show, and the per-layer probe must name the layer. V4's reference is checked against transformers too."""

import pytest

from tools.bench_engine import random_prompts
from tools.check_teacher_forced import build_engines, build_reference, check, perturb_layer, switch_verdicts


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

    clean = check(ref, test, prompts, steps, probes=1, oracle=family == "v4")
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
        bad = check(ref, test, prompts, steps, probes=1, teacher=teacher)
        assert bad["mean_kl"] > 1e-3
        (probe,) = bad["probes"]
        assert probe["jump"] == 1 and probe["layers"][0] < 1e-5 < 1e-1 < probe["layers"][1]
    if family == "v4":  # the rounded reference (bf16 where the kernels store) still names the planted layer
        rounded = build_reference(model, len(lens), max(lens) + steps + 1, {"dtype": "float32"}, "rounded")
        bad = check(rounded, test, prompts, steps, probes=1)
        (probe,) = bad["probes"]
        assert bad["reference"] == "rounded" and rounded.runner.replays == 0
        assert probe["jump"] == 1 and probe["layers"][0] < 2e-2 < 1e-1 < probe["layers"][1]


def test_switch_verdicts_smoke():
    """The switches' table on the CPU, where the engine serves the references (no switch changes them): PDL
    identical, a fusion rounding, every row against the same reference logits."""
    steps, lens = 2, (9, 14)
    ref, test = build_engines("", len(lens), max(lens) + steps + 1, {}, "rounded")
    prompts = [p[:n] for p, n in zip(random_prompts(len(lens), max(lens), ref.cfg.vocab_size, seed=1), lens)]
    rows = switch_verdicts(ref, test, prompts, steps, ["pdl", "mega_mhc"])
    assert [r["switch"] for r in rows] == ["base", "pdl", "mega_mhc"]
    assert [r["verdict"] for r in rows] == ["-", "identical", "rounding"]
    assert rows[2]["mean_kl"] == rows[0]["mean_kl"] and rows[0]["positions"] == len(lens) * steps
