"""What the OpenAI front (backend/openai) costs per streamed token, beside Triton direct, on a real tritonserver.

    python -m tools.profile_front [--model DIR] [--users 32] [--requests 4] [--max-tokens 64]
                                  [--workers 1] [--cprofile FRONT.prof] [--json OUT.json]

One server, one front (`python -m backend.openai`, as `make serve` starts it); the same load twice:
`--users` users, each `--requests` streamed requests one after another, first straight to Triton's
gRPC (client/grpc.py), then through the front's /v1/completions with the running usage on every
chunk (loadtest/openai_stream.py: what the load tests send). Per leg: output tokens per second, the
front process's CPU (all its threads, /proc) per output token and per request, and this client's CPU
in cores (near one: the client, not the server, was the limit). --cprofile runs the front under
cProfile (with --workers 1) and writes its profile there when it exits (read it with `python -m pstats`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from backend.openai.process import OpenAIProcess, tokenizer_dir
from backend.process_tree import descendants
from backend.serve import TritonServer
from client.grpc import GrpcClient
from loadtest.openai_stream import OpenAIStreamClient
from tools.profile_serving import _process_cpu_s

LEGS = ("triton", "openai")


def drive(make_client, users: int, requests: int, max_tokens: int) -> dict:
    """`users` threads, each `requests` streamed requests in turn; tokens counted from the deltas."""
    tokens, errors = [0] * users, []

    def user(i: int) -> None:
        client = make_client()
        try:
            for r in range(requests):
                try:
                    for d in client.generate_stream(f"user {i} request {r}: tell me a story", max_tokens=max_tokens,
                                                    temperature=0, ignore_eos=True):
                        tokens[i] += d.num_output_tokens or 0
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(repr(e))
        finally:
            getattr(client, "close", lambda: None)()

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(tokens), "errors": errors[:5], "error_count": len(errors),
            "client_cores": (time.process_time() - cpu0) / wall}


def front_cpu_s(front: OpenAIProcess) -> float:
    """The front's CPU seconds so far: its process (with `-m cProfile` the same process) and any children."""
    pid = front.process.pid
    return sum(_process_cpu_s(p) for p in (pid, *descendants(pid)))


def leg(name: str, server: TritonServer, front: OpenAIProcess, users: int, requests: int, max_tokens: int) -> dict:
    if name == "triton":
        make_client = lambda: GrpcClient(server.grpc_url)  # noqa: E731
    else:
        url = front.base_url.removeprefix("http://").removesuffix("/v1")
        make_client = lambda: OpenAIStreamClient(url)  # noqa: E731
    drive(make_client, min(users, 4), 1, 4)  # warm: streams, caches, the front's first requests
    before = front_cpu_s(front)
    r = drive(make_client, users, requests, max_tokens)
    cpu = front_cpu_s(front) - before
    n = users * requests
    return {"leg": name, "users": users, "requests": n, **r,
            "output_tok_s": r["output_tokens"] / r["wall_s"],
            "front_cpu_s": cpu, "front_cores": cpu / r["wall_s"],
            "front_us_per_token": cpu / r["output_tokens"] * 1e6 if r["output_tokens"] else None,
            "front_us_per_request": cpu / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    ap.add_argument("--engine-args", default="{}", help="JSON merged into model.json")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="per user, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--legs", default=",".join(LEGS), help="which of triton,openai to run, in order")
    ap.add_argument("--workers", default="1", help="the front's --workers (auto: as `make serve` sizes it)")
    ap.add_argument("--cprofile", default=None, help="run the front under cProfile, its profile written here")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    engine_args = {"max_num_seqs": max(16, a.users), **json.loads(a.engine_args)}
    rows = []
    with TritonServer(model=a.model, engine_args=engine_args, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=600) as server:
        model_json = server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json"
        launcher = ("-m", "cProfile", "-o", a.cprofile) if a.cprofile else ()
        with OpenAIProcess(server.grpc_url, port=0, tokenizer=tokenizer_dir(model_json), launcher=launcher,
                           extra_args=("--workers", a.workers),
                           log_path=server.workdir / "openai.log") as front:
            for name in a.legs.split(","):
                rows.append(leg(name, server, front, a.users, a.requests, a.max_tokens))
            if a.cprofile:  # uvicorn re-raises the signal it stopped on: SIGINT's KeyboardInterrupt lets cProfile write
                front.process.send_signal(signal.SIGINT)
                front.process.wait(30)
    print("leg | users | requests | errors | output tokens | wall s | output tok/s | front cores | "
          "front CPU us/token | front CPU us/request | client cores")
    for r in rows:
        print(f"{r['leg']} | {r['users']} | {r['requests']} | {r['error_count']} | {r['output_tokens']} | "
              f"{r['wall_s']:.1f} | {r['output_tok_s']:.0f} | {r['front_cores']:.2f} | "
              f"{r['front_us_per_token'] or 0:.0f} | {r['front_us_per_request']:.0f} | {r['client_cores']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"legs": rows}, f, indent=2)
    return 1 if any(r["error_count"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
