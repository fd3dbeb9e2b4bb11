"""tools/check_pdl_paths.py on the tiny checkpoints, on the CPU: every path it must check runs (static batches in
place of the graphs) for each engine kind, PDL on and off agree (no PDL on the CPU: trivially), and a planted
difference in one engine shows on the paths it touches."""

import pytest

from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from tests.engine.conftest import single_thread  # noqa: F401  (a fixture: tiny ops, one thread)
from tools import check_pdl_paths
from tools.check_pdl_paths import check_pair, engine_args
from tools.check_teacher_forced import perturb_layer

pytestmark = [pytest.mark.usefixtures("single_thread")]
BUDGET, BATCHES = 32, [1, 2]


@pytest.fixture(scope="module")
def tiny_0731(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("pdl_paths"), "tiny", seed=7, layout="0731"))


@pytest.mark.parametrize("kind", ["plain", "mtp", "dspark"])
def test_every_path_runs_and_agrees(kind, request):
    spec = {"plain": None, "mtp": {"method": "mtp", "num_speculative_tokens": 3}, "dspark": {"method": "dspark"}}[kind]
    model = request.getfixturevalue("tiny_0731") if kind == "dspark" else ""
    rows, missing, launched = check_pair(engine_args(model, BUDGET, max(BATCHES), spec), BATCHES, kind)
    assert missing == [] and not launched
    assert all(r["identical"] and r["records"][0] == r["records"][1] > 0 for r in rows)
    want = {"plain": "decode graph b2", "mtp": "MTP rollback graph", "dspark": "DSpark plain-step graph b2"}[kind]
    assert any(r["path"].startswith(want) for r in rows)


def test_a_planted_difference_shows(monkeypatch):
    """The PDL-on engine's layer 1 scaled: every logits path and the sampled tokens differ."""
    build = check_pdl_paths.build

    def planted(args, on):
        eng = build(args, on)
        if on:
            perturb_layer(eng, 1, 1.5)
        return eng
    monkeypatch.setattr(check_pdl_paths, "build", planted)
    rows, missing, _ = check_pair(engine_args("", BUDGET, max(BATCHES), None), BATCHES, "plain")
    assert missing == [] and rows
    assert not any(r["identical"] for r in rows), [r for r in rows if r["identical"]]
