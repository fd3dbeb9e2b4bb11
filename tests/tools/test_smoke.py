"""One smoke test per dev tool in tools/: it imports and parses its command line, and the tools with
a CPU path worth running run on a tiny input and write well-formed output. What the tools measure is
the benchmarks' business (docs/PERF.md), not the tests'; the kernels they time have their own tests."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# every tool with a command line (bench_compress and mixed_diag are libraries of other tools)
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py") if "def main(" in p.read_text())


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_imports_and_parses_its_command_line(tool, monkeypatch, capsys):
    module = importlib.import_module(f"tools.{tool}")
    monkeypatch.setattr(sys, "argv", [tool, "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_bench_spec_runs_on_the_tiny_model_and_writes_its_json(tmp_path, monkeypatch):
    """The forced leg replays the speculative run's own outputs, so every draft is accepted: the one
    figure here that says the tool measures what it claims."""
    from tools import bench_spec

    out = tmp_path / "spec.json"
    monkeypatch.setattr(sys, "argv", ["bench_spec", "--batches", "2", "--input-len", "12", "--output-len", "8",
                                      "--reps", "1", "--engine-args", '{"dtype":"float32","max_model_len":64}',
                                      "--json", str(out)])
    bench_spec.main()
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["micro"]] == [2] and set(result["micro"][0]["speedup"]) >= {"k3_a1"}
    (e2e,) = result["end_to_end"]
    assert e2e["forced_acceptance"] == 1.0 and e2e["forced_same_as_mtp"] == 2


def test_bench_spec_dspark_runs_on_a_tiny_0731_checkpoint(tmp_path, monkeypatch):
    from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
    from tools import bench_spec

    ckpt = write_checkpoint(tmp_path / "ckpt", "tiny", layout="0731", override={"index_topk": 32})
    out = tmp_path / "dspark.json"
    monkeypatch.setattr(sys, "argv", ["bench_spec", "--method", "dspark", "--model", str(ckpt), "--batches", "2",
                                      "--input-len", "20", "--output-len", "8", "--reps", "1", "--engine-args",
                                      '{"dtype":"float32","max_model_len":64}', "--json", str(out)])
    bench_spec.main()
    result = json.loads(out.read_text())
    (row,) = result["micro"]
    assert {"verify_k5_ms", "draft_ms", "stage_row_ms"} <= set(row) and set(row["speedup"]) >= {"dspark_k5_L5.4", "mtp_k3_L4.4"}
    (e2e,) = result["end_to_end"]
    assert e2e["forced_acceptance"] == 1.0 and e2e["forced_same_as_dspark_ungated"] == 2  # forced: the ungated run replayed
    assert "plain_async" in e2e["dspark_step_paths"]


def test_sass_report_reads_the_sass_of_a_kernel_compiled_for_sm90():
    """No GPU needed: Triton's own ptxas and cuobjdump. A bf16 tile product at 4 warps runs on wgmma, its K loop
    (--loop) holding the MMAs and the next tile's async loads, a part of the kernel's instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler
    lines = subprocess.run([sys.executable, "-m", "tools.sass_report", "tests.tools.sass_kernels:tile_product",
                            "--types", "*bf16,*bf16,*fp32,i32", "--const", "BLOCK=64", "--warps", "4", "--stages", "3",
                            "--div16", "K", "--loop"], capture_output=True, text=True, env=env, cwd=ROOT,
                           check=True).stdout.splitlines()
    counts, loop = ({k: int(v) for k, v in zip(words[::2], words[1::2])} for words in (lines[0].split(), lines[1].split()))
    assert counts["HGMMA"] > 0 and counts["HMMA"] == 0 and counts["LDGSTS"] > 0
    assert 0 < loop["HGMMA"] <= counts["HGMMA"] and loop.get("LDGSTS", 0) > 0 and loop["loop"] == sum(
        n for op, n in loop.items() if op != "loop")


def test_bench_v41_share_runs_a_tiny_share_and_writes_its_json(tmp_path, monkeypatch):
    """Rank 0's share at world 2 of a tiny V4.1, its Engram rows in host memory: decode and TTFT rows
    with the Engram gather timed, decode steps with host and device tables at a smaller row count (the
    figures themselves are the H200 suite's)."""
    from tools import bench_v41_share

    out = tmp_path / "share.json"
    monkeypatch.setattr(sys, "argv", ["bench_v41_share", "--preset", "v41-tiny", "--experts", "8", "--engram-vocab",
                                      "500", "--compare-vocab", "300", "--worlds", "2", "--batches", "2", "--ttft", "32",
                                      "--input-len", "16", "--steps", "2", "--check", "--json", str(out)])
    bench_v41_share.main()
    result = json.loads(out.read_text())
    assert all(c["identical_streams"] == c["of"] for c in result["check"].values()), result["check"]
    (world,) = result["worlds"]
    assert world["world"] == 2 and world["heads"] == 2 and world["experts"] == 4
    assert [d["batch"] for d in world["decode"]] == [2] and [t["prompt"] for t in world["ttft"]] == [32]
    assert world["decode"][0]["gather_ms"] > 0 and world["ttft"][0]["gather_ms"] > 0
    (cmp,) = world["compare"]["decode"]
    assert world["compare"]["identical_rows"] and cmp["host_ms"] > 0 and cmp["device_ms"] > 0


def test_bench_front_bodies_measures_the_sessions_front(openai_server):
    """Large bodies (parsed in the front's workers) at the session's front: every one refused 400 by
    its stop_token_ids cap, the probe answered throughout, the workers' memory counted."""
    from tools.bench_front_bodies import measure

    row = measure(openai_server.process.pid, openai_server.port, "ints", clients=2, mib=0.5, seconds=1.0,
                  baseline_s=0.5)
    assert set(row["statuses"]) == {"400"} and row["probe_failures"] == 0 and row["probe_requests"] > 0, row
    assert row["total_rss_peak_mb"] > row["front_rss_peak_mb"] > 0 and row["workers_rss_peak_mb"] > 0, row
