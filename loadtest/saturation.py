"""Was the load generator the limit? How many client processes a level gets, and the check run
on every level (loadtest.sweep, tools.bench_engine's online mode).

Two signs that the clients, not the server, set a level's figures:

- CPU: each client process's own CPU time over the run window (`time.process_time`, every thread
  of the process). A Python process handles its users on about one core (the GIL; Locust's gevent
  hub), so a process near one core is saturated; so are clients whose sum nears the cores they
  may run on. Only the clients' own CPU counts: a host kept busy by a server on the same cores
  (the 2-core CPU machine) is the server's limit, not the clients'.
- Little's law: closed-loop users each send their next request when the last one ends, so N users
  should keep N requests (or think times) going at every instant: achieved req/s = N / (mean
  request time + think time). Measured as its occupancy form, the time-averaged number of users
  in a request or thinking over N (= achieved / expected req/s, free of the bias of counting
  whole requests in a short window); a user idle between requests is waiting on its own client.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

USERS_PER_PROCESS = 16  # one Python process streaming ~1k tok/s stays far from its ~3.7k tok/s ceiling
SERVER_CORES = 2  # left to a server on the same host when sizing client processes
CPU_BOUND = 0.85  # a client process above this share of one core, or clients above it of their cores
BUSY_BOUND = 0.85  # users busy (in a request or thinking) below this share: the clients held them back


def available_cores() -> int:
    """The cores this process (and the client processes it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_processes(users: int, cores: int | None = None) -> int:
    """Client processes for a level: one per USERS_PER_PROCESS users, at most the host's cores less
    the server's share (at least one)."""
    cores = available_cores() if cores is None else cores
    return max(1, min(math.ceil(users / USERS_PER_PROCESS), cores - SERVER_CORES))


def parse_processes(text: str) -> int | None:
    """`--client-processes`: 'auto' -> None (sized per level), else an integer >= 1."""
    if text == "auto":
        return None
    n = int(text)
    if n < 1:
        raise ValueError("client processes: 'auto' or an integer >= 1")
    return n


@dataclass
class ProcessCpu:
    """One client process's CPU over the run window."""

    pid: int
    cpu_s: float
    wall_s: float

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def users_busy(intervals: dict[object, list[tuple[float, float]]], stop: float, start: float) -> dict:
    """Little's law in its occupancy form. `intervals`: per user, its (begin, end) times in a request
    or thinking. Each user is counted from its first request (or `start`, if later: a ramp-up is not
    idleness) to `stop`; overlaps are clipped to that span."""
    busy = span = 0.0
    for spans in intervals.values():
        if not spans:
            continue
        first = max(start, min(b for b, _ in spans))
        if first >= stop:
            continue
        span += stop - first
        busy += sum(max(0.0, min(e, stop) - max(b, first)) for b, e in spans)
    return {"busy_ratio": busy / span if span > 0 else None, "busy_user_s": busy, "user_s": span}


def check(users: int, mean_request_s: float | None, think_s: float, achieved_req_per_s: float,
          busy_ratio: float | None, processes: list[ProcessCpu], cores: int | None = None) -> dict:
    """The level's saturation verdict and the figures behind it (stored in the sweep's JSON)."""
    cores = available_cores() if cores is None else cores
    reasons = []
    busiest = max((p.cores for p in processes), default=None)
    total = sum(p.cores for p in processes) if processes else None
    if busiest is not None and busiest >= CPU_BOUND:
        reasons.append(f"a client process used {busiest:.2f} of a core")
    if total is not None and total >= CPU_BOUND * cores:
        reasons.append(f"the clients used {total:.2f} of {cores} cores")
    if busy_ratio is not None and busy_ratio < BUSY_BOUND:
        reasons.append(f"users were busy {busy_ratio:.0%} of the time (Little's law)")
    cycle = (mean_request_s or 0.0) + think_s
    return {
        "client_bound": bool(reasons),
        "reasons": reasons,
        "client_processes": len(processes),
        "client_cpu": {"per_process": [asdict(p) | {"cores": p.cores} for p in processes],
                       "busiest_cores": busiest, "total_cores": total, "cores_available": cores},
        "littles_law": {"users": users, "mean_request_s": mean_request_s, "think_s": think_s,
                        "expected_req_per_s": users / cycle if cycle > 0 else None,
                        "achieved_req_per_s": achieved_req_per_s, "busy_ratio": busy_ratio},
    }


def describe(sat: dict | None) -> str:
    """The row's saturation cell: clients' CPU, users busy, and the verdict."""
    if not sat:
        return "client check n/a"
    cpu, law = sat["client_cpu"], sat["littles_law"]
    parts = []
    if cpu["busiest_cores"] is not None:
        parts.append(f"client CPU {cpu['busiest_cores']:.2f} max, {cpu['total_cores']:.2f}/{cpu['cores_available']} "
                     f"cores ({sat['client_processes']} proc)")
    if law["busy_ratio"] is not None:
        parts.append(f"users busy {law['busy_ratio']:.0%}")
    parts.append("CLIENT-BOUND" if sat["client_bound"] else "server-limited")
    return ", ".join(parts)
