"""What one streamed response costs the Triton model's Python, measured on a real tritonserver.

    python -m tools.profile_serving [--model DIR] [--users 32] [--requests 3] [--max-tokens 128]
    python -m tools.profile_serving --ttft [--requests 40] [--input-len 16] [--max-tokens 4]
    python -m tools.profile_serving --hops [--users 1] [--requests 20] [--input-len 16] [--max-tokens 64]
                                   [--client-processes auto]

Every streamed response is rendered (numpy + pb_utils tensors) and sent (IPC to the Triton
process, a round trip) by the model's response threads, under the GIL the engine's loop also
needs. Their CPU time per response bounds the responses per second one model instance can
stream; above that, the deltas that pile up for a request go out merged (backend/model.py), so
tokens per response rises (and the client's ITL with it) instead of the server falling behind. Read from the server's own counters
(`deepseek:stream_*_total`, `deepseek:response_thread_cpu_seconds_total`). Prints one table row;
--json writes it.

--ttft: one user's requests one after another, each TTFT as the client sees it against the model's
own (request in `execute` -> first token where the model receives its deltas;
vllm:time_to_first_token_seconds, split into queue time, up to the core's scheduling it, and
prefill time): the difference is what the client, gRPC, Triton and the response path add to a
request's first token. Engine-direct's TTFT
(tools.bench_engine --core-process --concurrency 1, same model and prompt length) is the one to hold
the model's prefill time against: suite serving_ttft runs both.

--hops: `--users` users stream `--requests` requests each, with the server's hop trace on
(engine/hop_trace.py): every hop of the path timed per token, from the client's send through Triton's
`execute`, the front, the engine core and back through the response threads to the client
(tools/hop_table.py), beside each thread's CPU per output token in the Triton stub (by the names
engine/os_threads.py gives them), the server processes' CPU, and tokens per response. The users run
in `--client-processes` processes (auto: one per 16 users), and the busiest one's CPU is printed: near
one core, the client, not the server, delayed what arrived.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from backend.process_tree import descendants
from backend.serve import TritonServer
from client.grpc import GrpcClient
from engine import hop_trace
from loadtest import saturation
from loadtest.scrape import SETTLE_S, delta, metric, metrics_text, scrape
from loadtest.workloads import WorkloadConfig, make_workload
from tools import hop_table

WARMUP_REQUESTS = 3  # the first requests pay one-time costs (a stream, caches)
CLIENT_TIMEOUT_S = 900.0  # --hops: a client process that died leaves the level failing, not hung


def run(server: TritonServer, users: int, requests: int, max_tokens: int) -> dict:
    errors: list[str] = []
    gaps: list[float] = []  # between a stream's consecutive responses, as its client sees them (ITL)

    def user(i: int) -> None:
        with GrpcClient(server.grpc_url) as client:
            for r in range(requests):
                try:
                    last = None
                    for _ in client.generate_stream(f"user {i} request {r}: tell me a story", max_tokens=max_tokens,
                                                    temperature=0, ignore_eos=True):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(repr(e))

    before = scrape(server.metrics_url)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(SETTLE_S)  # the engine-stats counters are polled every 0.5 s
    d = delta(before, scrape(server.metrics_url)) or {}
    responses, deltas, cpu = d.get("stream_responses", 0), d.get("stream_deltas", 0), d.get("response_thread_cpu_s", 0)
    per_response = cpu / responses if responses else None
    itl = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else None
    return {"itl_ms": None if itl is None else {"p10": itl[0] * 1e3, "p50": statistics.median(gaps) * 1e3,
                                                  "p90": itl[8] * 1e3},"users": users, "requests": users * requests, "errors": len(errors), "wall_s": wall,
            "stream_deltas": deltas, "stream_responses": responses,
            "tokens_per_response": deltas / responses if responses else None,
            "response_thread_cpu_s": cpu, "response_thread_busy": cpu / wall,
            "cpu_us_per_response": None if per_response is None else per_response * 1e6,
            "responses_per_s_ceiling": None if not per_response else 1 / per_response}


def ttft(server: TritonServer, requests: int, input_len: int, max_tokens: int, model: str | None) -> dict:
    """One user, `requests` streaming requests one after another on one client, each a prompt of
    `input_len` tokens that shares no prefix with the others (the sweep's `random` workload)."""
    session = make_workload(WorkloadConfig(tokenizer=model or "", input_len=str(input_len))).session(0)
    client_s = []
    with GrpcClient(server.grpc_url) as client:
        for r in range(WARMUP_REQUESTS + requests):
            if r == WARMUP_REQUESTS:
                before = metrics_text(server.metrics_url)
            prompt = session.next_request().prompt
            t0 = time.perf_counter()
            first = None
            for _ in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                first = first or time.perf_counter() - t0
            client_s.append(first)
    after = metrics_text(server.metrics_url)

    def mean_ms(histogram: str) -> float | None:
        n = metric(after, f"vllm:{histogram}_count") - metric(before, f"vllm:{histogram}_count")
        return (metric(after, f"vllm:{histogram}_sum") - metric(before, f"vllm:{histogram}_sum")) / n * 1e3 if n else None

    client_s = client_s[WARMUP_REQUESTS:]
    ms = lambda q: statistics.quantiles(client_s, n=10)[q] * 1e3
    return {"requests": requests, "input_len": input_len, "client_ttft_ms": {
            "p10": ms(0), "p50": statistics.median(client_s) * 1e3, "p90": ms(8),
            "mean": statistics.fmean(client_s) * 1e3},
            "model_ttft_mean_ms": mean_ms("time_to_first_token_seconds"),
            # the model's TTFT in two: arrival -> the core schedules it, then -> its first token on the loop
            "model_queue_mean_ms": mean_ms("request_queue_time_seconds"),
            "model_prefill_mean_ms": mean_ms("request_prefill_time_seconds")}


def _process_cpu_s(pid: int) -> float:
    """Every thread's CPU seconds: utime + stime, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(task: str) -> float:
    """One thread's CPU seconds (/proc/PID/task/TID): the scheduler's nanosecond count where the
    kernel keeps one; ticks (10 ms) are too coarse for threads that run in short bursts."""
    try:
        return int(Path(f"{task}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"{task}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(server: TritonServer) -> dict:
    """CPU seconds so far: each server process by its name, and each thread of the Triton stub by its
    OS name (threads of one name summed)."""
    processes, threads = {}, defaultdict(float)
    for pid in [server.process.pid, *descendants(server.process.pid)]:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            processes[f"{name} ({pid})"] = _process_cpu_s(pid)
            if name.startswith("triton_python"):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    task = f"/proc/{pid}/task/{tid}"
                    threads[Path(f"{task}/comm").read_text().strip()] += _thread_cpu_s(task)
        except OSError:  # gone meanwhile
            continue
    return {"processes": processes, "stub_threads": dict(threads)}


def _hop_client(url: str, level: int, first: int, users: int, requests: int, input_len: int, max_tokens: int,
                model: str | None, start, results) -> None:
    """One client process: users first..first+users-1 (threads), each WARMUP_REQUESTS requests, then
    at `start` (a barrier of every user and the parent) `requests` timed ones, one after another.
    Puts (client marks by request id, errors, this process's CPU seconds after `start`) on `results`."""
    workload = make_workload(WorkloadConfig(tokenizer=model or "", input_len=str(input_len)))
    client_marks: dict[str, list] = {}
    errors: list[str] = []
    cpu_from = []

    def user(i: int) -> None:
        session = workload.session(i)
        with GrpcClient(url) as client:
            for r in range(WARMUP_REQUESTS + requests):
                if r == WARMUP_REQUESTS:
                    start.wait()
                    cpu_from.append(time.process_time())
                rid, prompt = f"hops{level}-{i}-{r}", session.next_request().prompt
                marks, tokens = [("client_sent", 0, time.monotonic())], 0
                try:
                    for d in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                    request_id=rid):
                        tokens += d.num_output_tokens or 0
                        marks.append(("client_received", tokens, time.monotonic()))
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(repr(e))
                if r >= WARMUP_REQUESTS:
                    client_marks[rid] = marks

    threads = [threading.Thread(target=user, args=(i,)) for i in range(first, first + users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((client_marks, errors, time.process_time() - min(cpu_from, default=0.0)))


def hops(server: TritonServer, users: int, requests: int, input_len: int, max_tokens: int, model: str | None,
         trace_prefix: str, processes: int | None = None) -> dict:
    """Every user sends WARMUP_REQUESTS, then `requests` timed ones, one after another, from
    `processes` client processes (None: one per saturation.USERS_PER_PROCESS users): one process of
    many streaming threads is itself the limit well before the server (its GIL), and its delays
    would show as the server's sent -> client_received. Each request's client marks join the
    server's by its id (CLOCK_MONOTONIC: one clock for every process on the host)."""
    processes = min(users, processes or saturation.auto_processes(users))
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(users + 1, timeout=CLIENT_TIMEOUT_S), ctx.Queue()
    shares = [users // processes + (p < users % processes) for p in range(processes)]
    clients = [ctx.Process(target=_hop_client, args=(server.grpc_url, users, sum(shares[:p]), n, requests, input_len,
                                                     max_tokens, model, start, results), daemon=True)
               for p, n in enumerate(shares)]
    for client in clients:
        client.start()
    start.wait()
    cpu_before, t0 = server_cpu(server), time.perf_counter()
    client_marks, errors, process_cpu = {}, [], []
    for _ in clients:
        marks, failed, cpu_s = results.get(timeout=CLIENT_TIMEOUT_S)
        client_marks.update(marks)
        errors += failed
        process_cpu.append(cpu_s)
    wall, cpu_after = time.perf_counter() - t0, server_cpu(server)
    for client in clients:
        client.join()
    server_marks = {rid.rsplit("-", 1)[0]: m for rid, m in hop_table.load(trace_prefix).items()}
    per_request, gaps, responses, tokens = [], [], 0, 0
    for rid, marks in client_marks.items():
        received = [m for m in marks if m[0] == "client_received" and m[1] > 0]
        if not received:
            continue
        n = received[-1][1]
        tokens, responses = tokens + n, responses + len(received)
        gaps += [(b[2] - a[2]) * 1e3 for a, b in zip(received, received[1:])]
        per_request.append(hop_table.token_times(sorted(marks + server_marks.get(rid, []), key=lambda m: m[2]), n))
    used = {kind: {name: cpu_after[kind][name] - before for name, before in cpu_before[kind].items()
                   if name in cpu_after[kind]} for kind in cpu_before}
    return {"users": users, "requests": len(per_request), "errors": len(errors), "wall_s": wall,
            "output_tokens": tokens, "tokens_per_response": tokens / responses if responses else None,
            "client_processes": processes,
            "client_cpu_cores": sum(process_cpu) / wall,
            "client_busiest_process_cores": max(process_cpu) / wall,  # near 1: a client process (its GIL) was the limit
            "client_gap_ms": hop_table.stats(gaps), **hop_table.table(per_request),
            "cpu_us_per_token": {kind: {name: s / tokens * 1e6 for name, s in v.items() if s > 0}
                                 for kind, v in used.items()} if tokens else {}}


def _print_hops(r: dict) -> None:
    print(f"users {r['users']}, {r['requests']} requests, {r['errors']} errors, {r['output_tokens']} output tokens "
          f"in {r['wall_s']:.1f} s; tokens per response {r['tokens_per_response'] or 0:.2f}; client gap between "
          f"responses p50 {r['client_gap_ms'].get('p50', 0):.2f} ms; client CPU {r['client_cpu_cores']:.2f} cores in "
          f"{r['client_processes']} processes (busiest {r['client_busiest_process_cores']:.2f})")
    hop_table.print_table(r)
    for kind, rows in r["cpu_us_per_token"].items():
        print(f"\n{kind}: CPU us per output token")
        for name, us in sorted(rows.items(), key=lambda kv: -kv[1]):
            print(f"  {name:32s} {us:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    ap.add_argument("--engine-args", default="{}", help="JSON merged into model.json")
    ap.add_argument("--users", default="32", help="concurrent users (--hops: a list, one level after another)")
    ap.add_argument("--requests", type=int, default=None, help="per user, one after another (3; --ttft: 40)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (128; --ttft: 4)")
    ap.add_argument("--ttft", action="store_true", help="one user's TTFT: client against model (see above)")
    ap.add_argument("--hops", action="store_true", help="every hop of the path per token (see above)")
    ap.add_argument("--input-len", type=int, default=16, help="--ttft, --hops: prompt tokens")
    ap.add_argument("--client-processes", default="auto", type=saturation.parse_processes,
                    help="--hops: client processes per level ('auto': one per 16 users)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.requests = a.requests or (40 if a.ttft else 20 if a.hops else 3)
    a.max_tokens = a.max_tokens or (4 if a.ttft else 64 if a.hops else 128)
    levels = [int(u) for u in a.users.split(",")]
    engine_args = {"max_num_seqs": max(16, *levels), **json.loads(a.engine_args)}
    trace = tempfile.TemporaryDirectory(prefix="hops-")
    if a.hops:  # the server's processes inherit it
        os.environ[hop_trace.ENV] = os.path.join(trace.name, "trace")
    with trace, TritonServer(model=a.model, engine_args=engine_args, http_port=0, grpc_port=0, metrics_port=0,
                             startup_timeout_s=600) as server:
        if a.hops:
            r = {"levels": [hops(server, users, a.requests, a.input_len, a.max_tokens, a.model,
                                 f"{os.environ[hop_trace.ENV]}", a.client_processes) for users in levels]}
        elif a.ttft:
            r = ttft(server, a.requests, a.input_len, a.max_tokens, a.model)
        else:
            r = run(server, levels[0], a.requests, a.max_tokens)
    if a.hops:
        for level in r["levels"]:
            _print_hops(level)
    elif a.ttft:
        c, m = r["client_ttft_ms"], r["model_ttft_mean_ms"]
        print("requests | client TTFT p10 / p50 / p90 / mean ms | model TTFT mean ms (queue + prefill) | "
              "client - model (mean) ms")
        fmt = lambda x: "-" if x is None else f"{x:.2f}"
        print(f"{r['requests']} | {c['p10']:.2f} / {c['p50']:.2f} / {c['p90']:.2f} / {c['mean']:.2f} | {fmt(m)} "
              f"({fmt(r['model_queue_mean_ms'])} + {fmt(r['model_prefill_mean_ms'])}) | "
              f"{fmt(None if m is None else c['mean'] - m)}")
    else:
        _print_row(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


def _print_row(r: dict) -> None:
    print("users | requests | errors | deltas | responses | tokens/response | response threads busy | "
          "CPU us/response | ceiling responses/s | client ITL p10 / p50 / p90 ms")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    print(f"{r['users']} | {r['requests']} | {r['errors']} | {r['stream_deltas']:.0f} | {r['stream_responses']:.0f} | "
          f"{fmt(r['tokens_per_response'], '.2f')} | {r['response_thread_busy']:.1%} | "
          f"{fmt(r['cpu_us_per_response'], '.1f')} | {fmt(r['responses_per_s_ceiling'], '.0f')} | "
          + ("-" if r["itl_ms"] is None else " / ".join(f"{r['itl_ms'][q]:.2f}" for q in ("p10", "p50", "p90"))))


if __name__ == "__main__":
    main()
