"""The same load from plain OS threads (no Locust, no gevent): `sweep --driver threads`.

A reference for the Locust driver: the same workload, the same clients (client/grpc.py,
client/http.py), the same records. If Locust's users ran into a limit of their own (gevent's one
core, gRPC's gevent integration), the two drivers' numbers would part at high concurrency.

    python -m loadtest.threads CONFIG.json --protocol grpc --users 16 --duration 30 --stop-timeout 30
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from client.grpc import GrpcClient
from client.http import HttpClient
from loadtest.measure import Measure, RecordWriter
from loadtest.workloads import LoadConfig, WorkloadConfig, make_workload

ERROR_BACKOFF_S = 0.2


def run(config: LoadConfig, protocol: str, users: int, duration_s: float, stop_timeout_s: float) -> int:
    """Closed-loop users for duration_s; then in-flight requests get stop_timeout_s to finish.
    Threads still busy after that are abandoned (daemon threads, gone with the process), their
    requests recorded as cancelled with what they had streamed, as the Locust driver records users
    it stops mid-stream: a level whose requests outlive the window still counts its tokens."""
    workload = make_workload(WorkloadConfig.from_dict(config.workload))
    records = RecordWriter(config.records or None)
    stopping = threading.Event()
    in_flight: dict[int, tuple] = {}  # user -> (request, Measure); whoever pops it writes its record
    lock = threading.Lock()

    def user(index: int) -> None:
        session = workload.session(index, config.level_seed)
        if protocol == "grpc":
            client = GrpcClient(config.url, model=config.model)
        else:
            client = HttpClient(config.url, model=config.model, timeout_s=config.request_timeout_s)
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

    threads = [threading.Thread(target=user, args=(i,), daemon=True, name=f"user-{i}") for i in range(users)]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.threads", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="LoadConfig JSON (what loadtest.sweep writes per level)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--users", type=int, required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds")
    args = p.parse_args(argv)
    return run(LoadConfig.load(args.config), args.protocol, args.users, args.duration, args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
