"""The OpenAI front's memory and its small requests' stalls while clients send large bodies at once.

    python -m tools.bench_front_bodies [--clients 16] [--mib 16] [--seconds 20] [--kinds ints,prompt] [--json F]

Starts the tiny model's Triton server and the OpenAI front as `backend.serve --openai-port` does,
then, per body kind, `--clients` clients each send a body of `--mib` MiB to /v1/completions again
and again for `--seconds` (a 503 waits its Retry-After, as a polite client does), while a probe
sends GET /v1/models back to back. Reported per kind: the front's resident memory (its main
process and its body-parser workers, sampled every 10 ms, plus each process's kernel-kept peak,
VmHWM), the answers' statuses, and the probe's slowest answer against its slowest before the load.

Kinds: `ints` (stop_token_ids with millions of entries: the costliest parse, refused 400 in the
worker) and `prompt` (one long string: parsed, handed back to the front, refused 400 by the
model's prompt cap before anything is sent to Triton). The finding this answers: 16 parallel
16 MiB bodies took the unbounded front to 1.39 GB and stalled other requests up to 6.2 s.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import statistics
import threading
import time
from pathlib import Path

from backend.process_tree import descendants

MODEL = "deepseek_v4"
SAMPLE_S = 0.01
PROBE_GAP_S = 0.02
BASELINE_S = 3.0
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6


def body(kind: str, size: int) -> bytes:
    """A /v1/completions body of exactly `size` bytes."""
    if kind == "ints":
        head, tail = b'{"model":"%s","prompt":"hi","max_tokens":1,"stop_token_ids":[' % MODEL.encode(), b"1]}"
        n = (size - len(head) - len(tail)) // 2
        data = head + b"1," * n + tail
    else:
        head, tail = b'{"model":"%s","max_tokens":1,"prompt":"' % MODEL.encode(), b'"}'
        data = head + b"x" * (size - len(head) - len(tail)) + tail
    return data + b" " * (size - len(data))  # JSON allows trailing whitespace


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _hwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemorySampler:
    """The front's resident memory every SAMPLE_S: its main process, and its children (the workers) summed."""

    def __init__(self, front_pid: int):
        self.front_pid = front_pid
        self.peak_main = self.peak_workers = self.peak_total = 0
        self.workers: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        children, listed = [], 0.0
        while not self._stop.is_set():
            if time.monotonic() - listed > 0.2:  # workers are spawned on the first large body
                children, listed = list(descendants(self.front_pid)), time.monotonic()
                self.workers.update(children)
            main = _rss_bytes(self.front_pid)
            workers = sum(_rss_bytes(pid) for pid in children)
            self.peak_main, self.peak_workers = max(self.peak_main, main), max(self.peak_workers, workers)
            self.peak_total = max(self.peak_total, main + workers)
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Probe:
    """GET /v1/models back to back on one connection: each answer's seconds."""

    def __init__(self, port: int):
        self.port, self.times, self.failures = port, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("GET", "/v1/models")
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    self.failures += 1
            except OSError:
                self.failures += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            self.times.append(time.perf_counter() - start)
            self._stop.wait(PROBE_GAP_S)
        conn.close()

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _send(port: int, data: bytes) -> tuple[str, float]:
    """One large body: (its status, or how sending it failed; the Retry-After to honour)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return str(response.status), float(response.getheader("Retry-After") or 0)
    except OSError as e:  # refused before the body was all sent: the connection is closed under us
        return type(e).__name__, 1.0
    finally:
        conn.close()


def measure(front_pid: int, port: int, kind: str, clients: int, mib: float, seconds: float,
            baseline_s: float = BASELINE_S) -> dict:
    """One kind's run against a started front (pid, port)."""
    data = body(kind, int(mib * (1 << 20)))
    with Probe(port) as baseline:
        time.sleep(baseline_s)
    statuses: collections.Counter = collections.Counter()
    counting = threading.Lock()
    rss_before = _rss_bytes(front_pid)

    def client(deadline: float) -> None:
        while time.monotonic() < deadline:
            status, retry_after = _send(port, data)
            with counting:
                statuses[status] += 1
            time.sleep(retry_after)

    deadline = time.monotonic() + seconds
    with MemorySampler(front_pid) as memory, Probe(port) as probe:
        threads = [threading.Thread(target=client, args=(deadline,)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {
        "kind": kind, "clients": clients, "body_mib": mib, "seconds": seconds,
        "statuses": dict(sorted(statuses.items())),
        "front_rss_before_mb": round(rss_before / MB, 1),
        "front_rss_peak_mb": round(memory.peak_main / MB, 1),
        "workers_rss_peak_mb": round(memory.peak_workers / MB, 1),
        "total_rss_peak_mb": round(memory.peak_total / MB, 1),
        "vm_hwm_mb": {"front": round(_hwm_bytes(front_pid) / MB, 1),
                      **{f"worker_{pid}": round(_hwm_bytes(pid) / MB, 1) for pid in sorted(memory.workers)}},
        "probe_requests": len(probe.times), "probe_failures": probe.failures,
        "probe_max_ms": round(1000 * max(probe.times, default=0), 1),
        "probe_p99_ms": round(1000 * statistics.quantiles(probe.times, n=100)[98], 1) if len(probe.times) > 1 else None,
        "probe_baseline_max_ms": round(1000 * max(baseline.times, default=0), 1),
    }


def _row(r: dict) -> str:
    answers = " ".join(f"{k}:{v}" for k, v in r["statuses"].items())
    return (f"{r['kind']:>6} {r['clients']:>7} {r['body_mib']:>4g} {r['front_rss_before_mb']:>8.0f} "
            f"{r['front_rss_peak_mb']:>8.0f} {r['workers_rss_peak_mb']:>8.0f} {r['total_rss_peak_mb']:>8.0f} "
            f"{r['probe_baseline_max_ms']:>9.0f} {r['probe_max_ms']:>8.0f}  {answers}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--mib", type=float, default=16.0, help="each body's size (the front takes 16 MiB at most)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the clients send, per kind")
    parser.add_argument("--kinds", default="ints,prompt")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    from backend.serve import TritonServer, start_openai

    with TritonServer(http_port=0, grpc_port=0, metrics_port=0, startup_timeout_s=300) as server:
        front = start_openai(server, 0, "127.0.0.1", None)
        try:
            rows = [measure(front.process.pid, front.port, kind, args.clients, args.mib, args.seconds)
                    for kind in args.kinds.split(",")]
        finally:
            front.stop()
    print("  kind clients  MiB  rss0 MB front MB  work MB total MB  probe0 ms probe ms  answers")
    for r in rows:
        print(_row(r))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
