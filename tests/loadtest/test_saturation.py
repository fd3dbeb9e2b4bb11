"""The load generator's saturation check (loadtest.saturation) and its several client processes:
a level whose single client process cannot keep up with an instant server is `client-bound` and
fails the sweep; a level where the server is the limit is not; a level's processes merge into
one result whose counts are the sums of theirs and whose percentiles come from the merged samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import saturation
from loadtest.sweep import read_records, summarize
from loadtest.window import client_saturation, percentiles, window_of
from tests.loadtest.fake_server import FakeTriton

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = 1_000_000.0


def rec(user, start, e2e_ms, tokens=4, ok=True):
    gaps = [e2e_ms * (i + 1) / (tokens + 1) for i in range(tokens)]
    return {"kind": "request", "user": user, "start": T0 + start, "ok": ok, "cancelled": False, "error": None,
            "ttft_ms": gaps[0], "e2e_ms": e2e_ms, "tpot_ms": (gaps[-1] - gaps[0]) / (tokens - 1),
            "output_tokens": tokens, "server_num_output_tokens": tokens, "deltas": tokens, "max_tokens": tokens,
            "prompt_tokens": 10, "delta_ms": gaps}


def write_part(path: Path, records: list[dict], cpu_s: float) -> None:
    lines = [{"kind": "start", "t": T0}, *records, {"kind": "stopping", "t": T0 + 10},
             {"kind": "cpu", "pid": hash(path.name) % 10_000, "cpu_s": cpu_s, "wall_s": 10.0}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_merged_processes_sum_and_merged_percentiles(tmp_path):
    """Two worker processes' record files: the merged level counts every request and token of both,
    and its percentiles are those of all samples together (here far from the parts' average)."""
    fast = [rec(0, 0.5 * i, 100.0) for i in range(9)]  # user 0: nine 100 ms requests
    slow = [rec(1, 3.0 * i, 3000.0, tokens=8) for i in range(3)]  # user 1: three 3 s requests
    write_part(tmp_path / "records.jsonl.0", fast, cpu_s=2.0)
    write_part(tmp_path / "records.jsonl.1", slow, cpu_s=3.0)
    requests, marks = read_records(tmp_path / "records.jsonl")
    merged = summarize(requests, marks, concurrency=2)
    parts = [summarize(*read_records_file(tmp_path / f"records.jsonl.{i}"), concurrency=1) for i in (0, 1)]
    assert merged["requests"] == sum(p["requests"] for p in parts) == 12
    assert merged["output_tokens"] == sum(p["output_tokens"] for p in parts) == 9 * 4 + 3 * 8
    assert merged["output_tok_per_s"] == pytest.approx(sum(p["output_tok_per_s"] for p in parts))
    e2e = [r["e2e_ms"] for r in fast + slow]
    assert merged["e2e_ms"] == percentiles(e2e)
    assert merged["e2e_ms"]["p50"] == pytest.approx(100.0)  # 9 of 12 samples are 100 ms
    assert merged["e2e_ms"]["p50"] != pytest.approx(sum(p["e2e_ms"]["p50"] for p in parts) / 2)
    sat = client_saturation(requests, window_of(requests, marks), 2, merged["request_per_s"], marks["cpu"])
    assert [p["cpu_s"] for p in sat["client_cpu"]["per_process"]] == [2.0, 3.0]
    assert sat["client_cpu"]["total_cores"] == pytest.approx(0.5)


def read_records_file(path: Path):
    """One part on its own (read_records also merges PATH.* siblings, so read a copy)."""
    alone = path.parent / "alone" / "records.jsonl"
    alone.parent.mkdir(exist_ok=True)
    alone.write_text(path.read_text())
    return read_records(alone)


def test_users_busy_is_littles_law():
    # user a: busy 0-4 s and 6-10 s of a 10 s window; user b starts at 5 s (a ramp-up, not idleness)
    intervals = {"a": [(0.0, 4.0), (6.0, 11.0)], "b": [(5.0, 10.0)]}
    busy = saturation.users_busy(intervals, stop=10.0, start=0.0)
    assert busy["busy_ratio"] == pytest.approx((8.0 + 5.0) / (10.0 + 5.0))


def test_verdicts():
    cpu = lambda *cores: [saturation.ProcessCpu(i, c * 10.0, 10.0) for i, c in enumerate(cores)]
    assert not saturation.check(8, 1.0, 0.0, 8.0, 0.99, cpu(0.3, 0.4), cores=16)["client_bound"]
    hot = saturation.check(8, 1.0, 0.0, 8.0, 0.99, cpu(0.3, 0.95), cores=16)
    assert hot["client_bound"] and "0.95 of a core" in hot["reasons"][0]
    assert saturation.check(8, 1.0, 0.0, 8.0, 0.99, cpu(0.8, 0.8, 0.2), cores=2)["client_bound"]  # 1.8 of 2
    idle = saturation.check(150, 1.0, 0.0, 56.0, 0.37, cpu(0.5), cores=16)
    assert idle["client_bound"] and idle["littles_law"]["expected_req_per_s"] == pytest.approx(150.0)
    assert saturation.auto_processes(1, cores=16) == 1 and saturation.auto_processes(150, cores=16) == 10
    assert saturation.auto_processes(256, cores=16) == 14 and saturation.auto_processes(150, cores=2) == 1


def sweep(tmp_path: Path, url: str, *args: str, driver: str = "threads") -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "loadtest.sweep", "--out", str(tmp_path), "--label", "s", "--driver", driver,
           "--protocol", "http", "--url", url, "--metrics-url", "none", "--duration", "3", "--stop-timeout", "5",
           *args]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    return done, json.loads((tmp_path / "s.json").read_text())


def test_a_client_slower_than_the_server_is_client_bound(tmp_path):
    """One client process building 4096-token prompts against a server that answers at once: the
    users spend most of their time in their own client, never waiting on the server."""
    with FakeTriton() as server:
        done, result = sweep(tmp_path, server.url, "--concurrency", "2", "--client-processes", "1",
                             "--input-len", "4096", "--output-len", "1")
        (lv,) = result["levels"]
        assert done.returncode == 3, done.stdout + done.stderr
        assert lv["failure"] is None and lv["requests"] > 0
        assert lv["client_bound"] and lv["saturation"]["littles_law"]["busy_ratio"] < saturation.BUSY_BOUND
        assert "CLIENT-BOUND" in done.stdout and "was client-bound" in done.stdout
        csv_row = (tmp_path / "s.csv").read_text().splitlines()[1]
        assert ",True," in csv_row
        allowed, result = sweep(tmp_path / "allowed", server.url, "--concurrency", "2", "--client-processes", "1",
                                "--input-len", "4096", "--output-len", "1", "--allow-client-bound")
        assert allowed.returncode == 0, allowed.stdout + allowed.stderr
        assert result["levels"][0]["client_bound"]  # still marked


@pytest.mark.parametrize("driver, processes", [("threads", 2), ("locust", 3)])  # Locust: a master and 2 workers
def test_a_server_that_is_the_limit_is_not_client_bound(tmp_path, driver, processes):
    """Six users over two client processes against a server that serves two requests at a time,
    a token per 20 ms: the users queue at the server, their clients idle."""
    with FakeTriton(token_delay_s=0.02, max_running=2) as server:
        done, result = sweep(tmp_path, server.url, "--concurrency", "6", "--client-processes", "2",
                             "--input-len", "16", "--output-len", "8", driver=driver)
    assert done.returncode == 0, done.stdout + done.stderr
    (lv,) = result["levels"]
    assert lv["client_processes"] == 2 and not lv["client_bound"], lv["saturation"]
    sat = lv["saturation"]
    assert len(sat["client_cpu"]["per_process"]) == processes
    assert sat["client_cpu"]["busiest_cores"] < saturation.CPU_BOUND
    assert sat["littles_law"]["busy_ratio"] > 0.95
    assert len({r["user"] for r in lv["records"]}) == 6  # one user index each, across processes
    assert "server-limited" in done.stdout
    # the server served two at a time, so each request waited: E2E far above its own 8 x 20 ms
    assert lv["e2e_ms"]["p50"] > 2 * 8 * 20
