"""Benchmark: what one engine-core step message costs to move between two processes.

The core ships one step-output message per step (every running request's new token ids,
logprobs, finish state) to the front process. This measures, for the transports we could use,
the round trip of such a message (core -> front -> small ack back, like a step output and the
next add/abort) and the CPU it costs each side, at the batch sizes the engine runs.

    .venv/bin/python -m tools.bench_transport [--batches 1 64 150] [--iters 2000] [--json out.json]

Prints a table and writes JSON (docs/PROCESSES.md has the numbers and the choice).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import tempfile
import time

import msgpack
import zmq


def step_message(batch: int, logprobs: bool) -> list:
    """A step output as engine.messages encodes it: one row per request."""
    rows = []
    for i in range(batch):
        top = [{1000 + i: -0.25, 7: -2.5}] if logprobs else None
        rows.append([f"req-{i:05d}-3f2a9c1b7e44", "", [1000 + i], 512, 40 + i, 0, -12.5 - i, top, False, None])
    return [3, rows, [], None]


def encode_msgpack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode_msgpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _zmq_echo(path: str, iters: int) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"ipc://{path}-a")
    push.connect(f"ipc://{path}-b")
    for _ in range(iters + 1):
        decode_msgpack(pull.recv(copy=False).buffer)
        push.send(b"k")
    push.close(linger=1000)
    pull.close()


def bench_zmq(msg, iters: int) -> dict:
    path = os.path.join(tempfile.mkdtemp(), "t")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{path}-a")
    pull.bind(f"ipc://{path}-b")
    child = mp.get_context("spawn").Process(target=_zmq_echo, args=(path, iters))
    child.start()
    push.send(encode_msgpack(msg))
    pull.recv()  # warm: both ends connected
    return _measure(lambda: push.send(encode_msgpack(msg)), pull.recv, iters, child, lambda: (push.close(), pull.close()))


def encode_pickle(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


CODECS = {"pickle": (encode_pickle, pickle.loads), "msgpack": (encode_msgpack, decode_msgpack)}


def _pipe_echo(conn, iters: int, codec: str) -> None:
    decode = CODECS[codec][1]
    for _ in range(iters + 1):
        decode(conn.recv_bytes())
        conn.send_bytes(b"k")


def bench_pipe(msg, iters: int, codec: str) -> dict:
    encode = CODECS[codec][0]
    ours, theirs = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_pipe_echo, args=(theirs, iters, codec))
    child.start()
    ours.send_bytes(encode(msg))
    ours.recv_bytes()
    return _measure(lambda: ours.send_bytes(encode(msg)), ours.recv_bytes, iters, child, ours.close)


def _measure(send, recv, iters, child, close) -> dict:
    rtts = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        send()
        recv()
        rtts.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    child.join(30)
    close()
    rtts.sort()
    return {"rtt_p50_us": 1e6 * statistics.median(rtts), "rtt_p99_us": 1e6 * rtts[int(0.99 * len(rtts))],
            "sender_cpu_us_per_msg": 1e6 * cpu / iters, "msgs_per_s": iters / wall}


TRANSPORTS = {"zmq-ipc+msgpack": bench_zmq,
              "mp-pipe+pickle": lambda msg, iters: bench_pipe(msg, iters, "pickle"),
              "mp-pipe+msgpack": lambda msg, iters: bench_pipe(msg, iters, "msgpack")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 150])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default="docs/perf/bench_transport.json")
    a = ap.parse_args()
    rows = []
    for batch in a.batches:
        for logprobs in (False, True):
            msg = step_message(batch, logprobs)
            size = {"zmq-ipc+msgpack": len(encode_msgpack(msg)), "mp-pipe+pickle": len(encode_pickle(msg)),
                    "mp-pipe+msgpack": len(encode_msgpack(msg))}
            for name, bench in TRANSPORTS.items():
                rows.append({"transport": name, "batch": batch, "logprobs": logprobs, "bytes": size[name],
                             **bench(msg, a.iters)})
    print(f"{'transport':<18} {'batch':>5} {'lp':>3} {'bytes':>7} {'rtt p50 us':>11} {'rtt p99 us':>11} "
          f"{'send cpu us':>12} {'msg/s':>8}")
    for r in rows:
        print(f"{r['transport']:<18} {r['batch']:>5} {'y' if r['logprobs'] else 'n':>3} {r['bytes']:>7} "
              f"{r['rtt_p50_us']:>11.1f} {r['rtt_p99_us']:>11.1f} {r['sender_cpu_us_per_msg']:>12.1f} "
              f"{r['msgs_per_s']:>8.0f}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                   "date": time.strftime("%Y-%m-%d"), "iters": a.iters, "rows": rows}, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
