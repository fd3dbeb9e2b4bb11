"""The same load from plain OS threads (no Locust, no gevent): `sweep --driver threads`.

A reference for the Locust driver: the same workload, the same clients (client/grpc.py,
client/http.py, loadtest/openai_stream.py), the same records. If Locust's users ran into a limit
of their own (gevent's one core, gRPC's gevent integration), the two drivers' numbers would part
at high concurrency.

    python -m loadtest.threads CONFIG.json --protocol grpc --users 16 --duration 30 --stop-timeout 30 \
        [--processes 4]

With --processes N the users are split over N worker processes (one Python process streams on
about one core: its GIL), user indices and prompts as in one process. Each worker loads its
workload, says "ready" on its stdout and starts when this process answers "go" on its stdin, so
all run the same window; each writes its records to RECORDS.<worker>, which the sweep merges.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from client.grpc import GrpcClient
from client.http import HttpClient
from loadtest.measure import ERROR_BACKOFF_S, Measure, RecordWriter
from loadtest.openai_stream import OpenAIStreamClient
from loadtest.workloads import LoadConfig, WorkloadConfig, make_workload


def run(config: LoadConfig, protocol: str, users: int, duration_s: float, stop_timeout_s: float,
        first_user: int = 0, records_path: str | None = None, ready: Callable[[], None] | None = None) -> int:
    """Closed-loop users first_user .. first_user + users - 1 for duration_s; then in-flight
    requests get stop_timeout_s to finish. Threads still busy after that are abandoned (daemon
    threads, gone with the process), their requests recorded as cancelled with what they had
    streamed, as the Locust driver records users it stops mid-stream: a level whose requests outlive
    the window still counts its tokens. `ready` is called once set up, and returns when to start."""
    workload = make_workload(WorkloadConfig.from_dict(config.workload))
    records = RecordWriter(records_path if records_path is not None else (config.records or None))
    if ready is not None:
        ready()
    stopping = threading.Event()
    in_flight: dict[int, tuple] = {}  # user -> (request, Measure); whoever pops it writes its record
    lock = threading.Lock()

    def user(index: int) -> None:
        session = workload.session(index, config.level_seed)
        if protocol == "grpc":
            client = GrpcClient(config.url, model=config.model)
        elif protocol == "http":
            client = HttpClient(config.url, model=config.model, timeout_s=config.request_timeout_s)
        else:
            client = OpenAIStreamClient(config.url, model=config.model, timeout_s=config.request_timeout_s)
        try:
            while not stopping.is_set():
                request = session.next_request()
                m = Measure()
                error = None
                with lock:
                    in_flight[index] = (request, m)
                try:
                    kwargs = {"timeout_s": config.request_timeout_s} if protocol == "grpc" else {}
                    for delta in client.generate_stream(request.prompt, **kwargs, **config.sampling(request)):
                        m.add(delta)
                except Exception as e:  # noqa: BLE001 - a failed request is data
                    error = e
                with lock:
                    if in_flight.pop(index, None) is None:  # abandoned at the stop: recorded there
                        return
                rec = m.record(request, error, cancelled=False)
                records.write("request", user=index, **rec)
                if rec["ok"]:
                    session.on_reply(request, "".join(m.text))
                else:
                    time.sleep(ERROR_BACKOFF_S)
        finally:
            if protocol == "grpc":
                client.close()

    threads = [threading.Thread(target=user, args=(i,), daemon=True, name=f"user-{i}")
               for i in range(first_user, first_user + users)]
    records.mark("start")
    for t in threads:
        t.start()
    time.sleep(duration_s)
    records.mark("stopping")
    stopping.set()
    deadline = time.monotonic() + stop_timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    left = sum(t.is_alive() for t in threads)
    with lock:
        abandoned = list(in_flight.items())
        in_flight.clear()
    for index, (request, m) in abandoned:
        records.write("request", user=index, **m.record(request, None, cancelled=True))
    records.mark("stop")
    records.close()
    if left:
        # a stuck thread's gRPC stream would block the interpreter's exit (its client's __del__)
        print(f"{left} user(s) still in a request after the stop timeout; abandoned", file=sys.stderr,
              flush=True)
        os._exit(0)
    return 0


def shares(users: int, processes: int) -> list[int]:
    """Users per worker process: as even as they go, none empty."""
    n = max(1, min(processes, users))
    return [users // n + (1 if i < users % n else 0) for i in range(n)]


def run_processes(args) -> int:
    """Start a worker per share of the users, wait until every one is ready, start them together,
    and exit with the worst worker's exit code."""
    workers = []
    first = 0
    for i, n in enumerate(shares(args.users, args.processes)):
        cmd = [sys.executable, "-m", "loadtest.threads", args.config, "--protocol", args.protocol, "--users", str(n),
               "--first-user", str(first), "--duration", str(args.duration), "--stop-timeout",
               str(args.stop_timeout), "--worker", str(i)]
        workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first += n
    try:
        for w in workers:  # a worker that dies before "ready" gives an empty line (the sweep bounds a hang)
            if w.stdout.readline().strip() != "ready":
                print(f"a worker process did not start (exit code {w.poll()})", file=sys.stderr, flush=True)
                return 1
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        return max(w.wait() for w in workers)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


def wait_for_go() -> None:
    """A worker's handshake with run_processes: ready on stdout, then block until "go" on stdin."""
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)  # the parent went away


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.threads", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="LoadConfig JSON (what loadtest.sweep writes per level)")
    p.add_argument("--protocol", choices=["grpc", "http", "openai"], default="grpc")
    p.add_argument("--users", type=int, required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds")
    p.add_argument("--processes", type=int, default=1, help="worker processes the users are split over")
    p.add_argument("--first-user", type=int, default=0, help=argparse.SUPPRESS)  # a worker's first user index
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # started by run_processes
    args = p.parse_args(argv)
    if args.processes > 1 and args.worker is None:
        return run_processes(args)
    config = LoadConfig.load(args.config)
    if args.worker is None:
        return run(config, args.protocol, args.users, args.duration, args.stop_timeout)
    return run(config, args.protocol, args.users, args.duration, args.stop_timeout, first_user=args.first_user,
               records_path=f"{config.records}.{args.worker}" if config.records else None, ready=wait_for_go)


if __name__ == "__main__":
    sys.exit(main())
