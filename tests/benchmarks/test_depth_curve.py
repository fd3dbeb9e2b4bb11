"""The headline serving table's suites (depth_curve_*): they cover the levels issue 40 names, each
sweep's argv parses as loadtest.sweep reads it with engine arguments that hold its longest request and
its users, each fits one device call, and each report step reads the file its sweep writes."""

import json
from dataclasses import asdict

import pytest

from benchmarks import suites
from benchmarks.runner import fill
from benchmarks.suites import SUITES
from engine.args import EngineArgs
from loadtest import headline
from loadtest.sweep import build_parser
from loadtest.workloads import Length, WorkloadConfig
from tests.loadtest.test_headline import level

CURVES = [*suites.CURVES_1K, *suites.CURVES_8K, suites.CURVE_AGENTIC]


def sweep_args(curve):
    suite = SUITES[curve.name]
    (step,) = [s for s in suite.steps if s.tool == "loadtest.sweep"]
    values = {"out": "/out", "ckpt": "/ckpt", "preset": "", "python": "python"}
    return step, build_parser().parse_args([fill(a, values) for a in step.args])


def test_the_suites_cover_the_issues_levels():
    names = {n for n in SUITES if n.startswith("depth_curve")}
    assert names == {c.name for c in CURVES}
    users = lambda curves: {int(u) for c in curves for u in c.levels.split(",")}
    assert {1, 32, 64, 150, 256} <= users(suites.CURVES_1K) and {1, 8, 32, 64} <= users(suites.CURVES_8K)
    for whole in (suites.CURVES_1K, suites.CURVES_8K):  # each suite names the files of its whole curve
        for c in whole:
            assert " ".join(f"{x.label}.json" for x in whole) in SUITES[c.name].notes


@pytest.mark.parametrize("curve", CURVES, ids=lambda c: c.name)
def test_each_sweep_parses_and_its_server_holds_its_requests(curve):
    step, args = sweep_args(curve)
    assert args.serve and args.driver == "threads" and args.protocol == "grpc" and args.model == "/ckpt/flash-depth-fp8-fp4"
    assert args.concurrency == [int(u) for u in curve.levels.split(",")]
    assert (args.duration, args.stop_timeout) == (curve.duration_s, curve.stop_timeout_s)
    assert step.result == "{out}/" + args.label + ".json" and step.python == "triton"
    engine = EngineArgs.from_dict(json.loads(args.engine_args))
    assert engine.max_num_seqs >= max(args.concurrency) and engine.enable_prefix_caching
    high = lambda text: Length.parse(text).high
    if args.workload == "agentic":  # the last turn re-sends every earlier turn and reply
        longest = args.system_len + args.turns * (high(args.turn_len) + high(args.output_len))
    else:
        longest = high(args.input_len) + high(args.output_len)
    assert longest < engine.max_model_len, (longest, engine.max_model_len)
    assert 0 < args.warmup < args.duration  # the sweep's parser took the warm-up, inside the level
    assert curve.estimate_s() <= suites.CALL_BUDGET_S and step.timeout_s <= suites.CALL_BUDGET_S


@pytest.mark.parametrize("curve", CURVES, ids=lambda c: c.name)
def test_each_report_step_reads_its_sweeps_file(curve, tmp_path, capsys):
    step, args = sweep_args(curve)
    (table,) = [s for s in SUITES[curve.name].steps if s.tool == "loadtest.headline"]
    levels = [level(c, 20.0 + c, 10.0 * c) for c in args.concurrency]
    sweep = {"label": args.label, "protocol": "grpc", "gpus": 1, "levels": levels,
             "workload": asdict(WorkloadConfig(kind=args.workload, input_len=args.input_len,
                                               output_len=args.output_len)),
             "server": {"serve": True, "model": args.model, "engine_args": json.loads(args.engine_args)}}
    (tmp_path / f"{args.label}.json").write_text(json.dumps(sweep))
    out = tmp_path / "table.json"
    assert headline.main(["--json", str(out), *(fill(a, {"out": str(tmp_path)}) for a in table.args)]) == 0
    assert [r["tok_per_s_per_user"] for r in json.loads(out.read_text())["at"]] == [20.0, 50.0]
    assert f"| {args.concurrency[0]} |" in capsys.readouterr().out
