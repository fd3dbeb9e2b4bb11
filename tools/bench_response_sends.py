"""How fast can a decoupled Triton python model send streamed responses, from how many threads,
beside a thread that keeps the GIL busy (as the engine's event loop does under load)?

    python -m tools.bench_response_sends [--streams 16] [--responses 100] [--threads 1,4]
                                         [--switch-intervals-us 0,5000,500] [--json out.json]

A real tritonserver serves tools/data/response_sends (a model that only sends: 4 outputs per
response, as backend/model.py's streamed deltas). Per setting, `--streams` requests of
`--responses` responses each go out on one gRPC stream at once; the model counts its sends on
its own clock. Switch interval 0: no busy thread, Python's default interval. Prints one row per
setting (the send rate, CPU per send); backend/model.py's RESPONSE_THREADS and
GIL_SWITCH_INTERVAL_S come from these rows.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backend.serve import TritonServer

REPOSITORY = Path(__file__).resolve().parent / "data" / "response_sends"
MODEL = "response_sends"


def _inputs(responses: int, threads: int, interval_us: int) -> list:
    tensors = []
    for name, value in (("responses", responses), ("threads", threads), ("switch_interval_us", interval_us)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        tensors.append(tensor)
    return tensors


def measure(url: str, streams: int, responses: int, threads: int, interval_us: int) -> dict:
    finals = threading.Semaphore(0)
    errors: list[str] = []
    received = queue.Queue()

    def on_response(result, error):
        if error is not None:
            errors.append(str(error))
            finals.release()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            received.put(result)
            finals.release()

    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=on_response)
        for i in range(streams):
            client.async_stream_infer(MODEL, _inputs(responses, threads, interval_us), request_id=str(i),
                                      enable_empty_final_response=True)
        for _ in range(streams):
            finals.acquire()
        client.stop_stream()
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        client.start_stream(callback=on_response)
        client.async_stream_infer(MODEL, _inputs(0, threads, interval_us))
        finals.acquire()
        while received.qsize() > 1:  # the figures come last
            received.get()
        figures = json.loads(received.get().as_numpy("text_output")[0])
    finally:
        client.close()
    return {"threads": threads, "switch_interval_us": interval_us, "busy_thread": interval_us > 0,
            "streams": streams, "responses": responses, **figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--responses", type=int, default=100, help="per stream")
    ap.add_argument("--threads", default="1,4", help="sender threads, comma-separated")
    ap.add_argument("--switch-intervals-us", default="0,5000,500",
                    help="0: no busy thread, the default interval; else a busy thread and this interval")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over every setting")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print("busy thread | switch interval us | sender threads | sends/s | CPU us/send")
    with TritonServer(http_port=0, grpc_port=0, metrics_port=0, model_repository=REPOSITORY,
                      startup_timeout_s=300) as server:
        for _ in range(a.repeat):
            for interval_us in map(int, a.switch_intervals_us.split(",")):
                for threads in map(int, a.threads.split(",")):
                    r = measure(server.grpc_url, a.streams, a.responses, threads, interval_us)
                    rows.append(r)
                    print(f"{'yes' if r['busy_thread'] else 'no'} | {interval_us or 'default'} | {threads} | "
                          f"{r['per_s'] or 0:,.0f} | {r['cpu_us_per_send'] or 0:.1f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
