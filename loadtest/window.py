"""The measurement window of one closed-loop level, and what its request records give inside it.

One accounting for every closed-loop load: loadtest.sweep (Locust and thread drivers, through a
server) and tools.bench_engine's `--duration` mode (the engine called directly), so a ratio of
their rates compares like with like. A level's users issue requests back to back from `start`
until `stopping`; the first `warmup_s` of that are not counted:

- the window is [start + warmup_s, stopping];
- rates count events inside it: output tokens by each streamed delta's arrival (cancelled
  requests' too), requests and their prompt tokens by completion; each over the window's length;
- latency percentiles cover the completed requests that started inside the window (a request
  sent during the warm-up is the warm-up's, as aiperf discards its warm-up requests).

A request record is what loadtest.measure.Measure.record writes (start: wall-clock seconds;
delta_ms: each token-carrying delta's arrival since the start; delta_tokens when a delta carried
more than one token), with its user's index.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from loadtest import saturation
from loadtest.measure import ERROR_BACKOFF_S

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 (linear interpolation, as numpy's default), mean, count."""
    if not values:
        return {"count": 0}
    xs = sorted(values)

    def at(q: float) -> float:
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {**{f"p{q}": at(q) for q in PERCENTILES}, "mean": statistics.fmean(xs), "count": len(xs)}


@dataclass(frozen=True)
class Window:
    """[start, stop] in the records' clock: the run's start + warm-up, and when users stopped issuing."""

    start: float
    stop: float
    warmup_s: float = 0.0

    @property
    def length_s(self) -> float:
        return max(self.stop - self.start, 1e-9)


def describe(duration_s: float, warmup_s: float) -> str:
    """A level's accounting in a table cell: "window 5+20 s" (warm-up + counted seconds)."""
    return f"window {warmup_s:g}+{duration_s - warmup_s:g} s"


def end_s(r: dict) -> float:
    return r["start"] + r["e2e_ms"] / 1e3


def window_of(requests: list[dict], marks: dict, warmup_s: float = 0.0) -> Window:
    """The level's window from its marks ("start", "stopping"); without them (a load process killed
    before writing one), from the first request sent to the last one ended."""
    begin = marks.get("start") or min((r["start"] for r in requests), default=0.0)
    stop = marks.get("stopping") or max((end_s(r) for r in requests), default=begin)
    return Window(begin + warmup_s, max(stop, begin + warmup_s), warmup_s)


def figures(requests: list[dict], window: Window) -> dict:
    """Rates inside the window and latency percentiles of the requests it measured."""
    ok = [r for r in requests if r["ok"]]
    streamed = ok + [r for r in requests if r["cancelled"]]
    tokens = 0
    for r in streamed:
        counts = r.get("delta_tokens") or [1] * len(r.get("delta_ms", []))
        tokens += sum(n for t, n in zip(r.get("delta_ms", []), counts)
                      if window.start <= r["start"] + t / 1e3 <= window.stop)
    completed = [r for r in ok if window.start <= end_s(r) <= window.stop]
    measured = [r for r in ok if r["start"] >= window.start]
    return {
        "window_s": window.length_s,
        "warmup_s": window.warmup_s,
        "request_per_s": len(completed) / window.length_s,
        "output_tok_per_s": tokens / window.length_s,
        "input_tok_per_s": sum(r["prompt_tokens"] for r in completed) / window.length_s,
        "ttft_ms": percentiles([r["ttft_ms"] for r in measured]),
        "itl_ms": percentiles([b - a for r in measured for a, b in zip(r["delta_ms"], r["delta_ms"][1:])]),
        "tpot_ms": percentiles([r["tpot_ms"] for r in measured if r["tpot_ms"] is not None]),
        "e2e_ms": percentiles([r["e2e_ms"] for r in measured]),
    }


def client_saturation(requests: list[dict], window: Window, concurrency: int, request_per_s: float,
                      cpu: list[dict]) -> dict:
    """loadtest.saturation's check over the window: each user's time in a request (a failed one with
    the pause after it) against the window, and the client processes' own CPU (`cpu`: the records'
    {"pid", "cpu_s", "wall_s"} per process)."""
    intervals: dict = {}
    for r in requests:
        pause = ERROR_BACKOFF_S if not r["ok"] and not r["cancelled"] else 0.0
        intervals.setdefault(r.get("user"), []).append((r["start"], end_s(r) + pause))
    busy = saturation.users_busy(intervals, window.stop, window.start)
    ok = [r["e2e_ms"] / 1e3 for r in requests if r["ok"]]
    procs = [saturation.ProcessCpu(c["pid"], c["cpu_s"], c["wall_s"]) for c in cpu]
    return saturation.check(concurrency, statistics.fmean(ok) if ok else None, 0.0, request_per_s,
                            busy["busy_ratio"], procs)
