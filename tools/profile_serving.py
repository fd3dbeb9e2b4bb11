"""What one streamed response costs the Triton model's Python, measured on a real tritonserver.

    python -m tools.profile_serving [--model DIR] [--users 32] [--requests 3] [--max-tokens 128]

Every streamed response is rendered (numpy + pb_utils tensors) and sent (IPC to the Triton
process) by one Python thread of the model, under the GIL the engine's step loop also needs.
Its CPU time per response bounds the responses per second one model instance can stream; above
that, the deltas that pile up for a request go out merged (backend/model.py), so tokens per
response rises instead of the server falling behind. Read from the server's own counters
(`deepseek:stream_*_total`, `deepseek:response_thread_cpu_seconds_total`). Prints one table row;
--json writes it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from backend.serve import TritonServer
from client.grpc import GrpcClient
from loadtest.scrape import SETTLE_S, delta, scrape


def run(server: TritonServer, users: int, requests: int, max_tokens: int) -> dict:
    errors: list[str] = []

    def user(i: int) -> None:
        with GrpcClient(server.grpc_url) as client:
            for r in range(requests):
                try:
                    for _ in client.generate_stream(f"user {i} request {r}: tell me a story", max_tokens=max_tokens,
                                                    temperature=0, ignore_eos=True):
                        pass
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
    return {"users": users, "requests": users * requests, "errors": len(errors), "wall_s": wall,
            "stream_deltas": deltas, "stream_responses": responses,
            "tokens_per_response": deltas / responses if responses else None,
            "response_thread_cpu_s": cpu, "response_thread_busy": cpu / wall,
            "cpu_us_per_response": None if per_response is None else per_response * 1e6,
            "responses_per_s_ceiling": None if not per_response else 1 / per_response}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    ap.add_argument("--engine-args", default="{}", help="JSON merged into model.json")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--requests", type=int, default=3, help="per user, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    engine_args = {"max_num_seqs": max(16, a.users), **json.loads(a.engine_args)}
    with TritonServer(model=a.model, engine_args=engine_args, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=600) as server:
        r = run(server, a.users, a.requests, a.max_tokens)
    print("users | requests | errors | deltas | responses | tokens/response | response thread busy | "
          "CPU us/response | ceiling responses/s")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    print(f"{r['users']} | {r['requests']} | {r['errors']} | {r['stream_deltas']:.0f} | {r['stream_responses']:.0f} | "
          f"{fmt(r['tokens_per_response'], '.2f')} | {r['response_thread_busy']:.1%} | "
          f"{fmt(r['cpu_us_per_response'], '.1f')} | {fmt(r['responses_per_s_ceiling'], '.0f')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
