"""The benchmarks runner end to end on the CPU (list, run the smoke suite, report, compare), a failing
step recorded without stopping the suite, and every suite's definition checked against the tools it
names."""

import importlib.util
import json
import re

import pytest

from benchmarks.__main__ import main
from benchmarks.runner import run_suite
from benchmarks.suite import Step, Suite
from benchmarks.suites import SUITES


def test_list_run_report_compare(tmp_path, capsys):
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SUITES)

    a = tmp_path / "a.json"
    assert main(["run", "smoke", "--out", str(a)]) == 0
    result = json.loads(a.read_text())
    assert result["suite"] == "smoke" and result["ok"] and result["preset"] == "tiny"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result["date"]) and result["machine"]["device"]
    assert re.fullmatch(r"[0-9a-f]{40}", result["commit"])
    (step,) = result["steps"]
    assert step["rc"] == 0 and (tmp_path / "smoke.bench_engine.log").exists()
    (row,) = step["figures"]["results"]
    assert (row["concurrency"], row["requests"], row["output_tokens"]) == (1, 1, 4)  # what the suite asked for
    capsys.readouterr()

    assert main(["report", str(a)]) == 0
    report = capsys.readouterr().out
    assert report.startswith("## smoke") and "| online | random | 1 | 1 |" in report

    row["output_tok_s"] *= 2
    b = tmp_path / "b.json"
    b.write_text(json.dumps(result))
    assert main(["compare", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (tok_s,) = [line for line in lines if "output_tok_s" in line]
    assert tok_s.startswith("| bench_engine.results[mode=online,concurrency=1].output_tok_s |")
    assert tok_s.endswith("| 2.000 |")


def test_a_failing_step_is_recorded_and_the_rest_still_run(tmp_path):
    suite = Suite("t", "does a failure stop the suite?", (Step("tools.no_such_tool", name="missing"),
                                                          Step("benchmarks", ("list",), json_flag=None)),
                  machine="cpu")
    result = run_suite(suite, work=tmp_path)
    missing, listed = result["steps"]
    assert missing["rc"] != 0 and "figures" not in missing and not result["ok"]
    assert listed["rc"] == 0 and any("decode_depth" in line for line in listed["output_tail"])


def test_a_preset_is_refused_by_a_suite_without_one(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "attention", "--preset", "tiny"])
    assert stop.value.code == 2 and "takes no --preset" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SUITES))
def test_suite_names_tools_that_exist_and_fills_every_placeholder(name):
    suite = SUITES[name]
    assert len({s.key for s in suite.steps}) == len(suite.steps), "two steps share a result key"
    uses_preset = False
    for step in suite.steps:
        assert importlib.util.find_spec(step.tool) is not None, step.tool
        fields = {f for text in (*step.args, step.result or "", step.unless_exists or "")
                  for f in re.findall(r"{(\w+)}", text)}
        assert fields <= {"out", "ckpt", "preset", "python"}, fields
        uses_preset |= "preset" in fields
        assert step.python in ("engine", "triton")
    assert uses_preset == (suite.preset is not None) and suite.machine in ("h200", "cpu")


def test_a_checkpoint_draw_makes_room_by_removing_checkpoints_the_suite_does_not_name(tmp_path, monkeypatch):
    """Before drawing a checkpoint the runner removes others under {ckpt}, oldest first, until the disk has room,
    never one its suite names; with room enough it removes nothing."""
    import os
    from types import SimpleNamespace

    from benchmarks import runner

    ckpt = tmp_path / "ckpt"
    for i, name in enumerate(["old", "mine", "newer", "newest"]):
        (ckpt / name).mkdir(parents=True)
        os.utime(ckpt / name, (1000 + i, 1000 + i))
    suite = Suite("s", "?", (Step("tools.make_tiny_checkpoint", ("{ckpt}/mine", "--preset", "tiny")),
                             Step("tools.bench_engine", ("--model", "{ckpt}/mine/x",))))
    values = {"ckpt": str(ckpt), "suite": "s"}
    keep = runner.suite_checkpoints(suite, values)
    assert keep == {"mine"}

    def usage(path):  # each removal frees 30 GB
        return SimpleNamespace(free=(4 - len(list(ckpt.iterdir()))) * (30 << 30))

    monkeypatch.setattr(runner.shutil, "disk_usage", usage)
    assert runner.make_room(ckpt, keep, need=50 << 30) == ["old", "newer"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["mine", "newest"]
    assert runner.make_room(ckpt, keep, need=50 << 30) == []
