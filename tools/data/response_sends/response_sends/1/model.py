"""tools.bench_response_sends' model: streams `responses` small responses per request, shaped as
backend/model.py's streamed deltas (4 outputs), from a pool of `threads` sender threads that takes
requests in turn (one request on one thread at a time, as backend/model.py's response threads do).
With `switch_interval_us` > 0 a thread beside them runs Python without pause, as the engine's event
loop does under load, and the interpreter's GIL switch interval is set to that value.
`responses` = 0 asks for the figures since the last such request (one JSON response)."""

import json
import queue
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.pools: dict[int, queue.SimpleQueue] = {}
        self.lock = threading.Lock()
        self.busy = False
        self.default_interval = sys.getswitchinterval()
        threading.Thread(target=self._busy_loop, daemon=True).start()
        self._reset()

    def _reset(self):
        self.sent, self.first, self.last, self.cpu_s = 0, None, None, 0.0

    def _busy_loop(self):
        while True:
            if self.busy:
                sum(range(2000))
            else:
                time.sleep(0.01)

    def _pool(self, threads: int) -> queue.SimpleQueue:
        with self.lock:
            if threads not in self.pools:
                self.pools[threads] = queue.SimpleQueue()
                for _ in range(threads):
                    threading.Thread(target=self._sender, args=(self.pools[threads],), daemon=True).start()
            return self.pools[threads]

    def _sender(self, work: queue.SimpleQueue):
        while True:
            sender, left = work.get()
            cpu = time.thread_time()
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([b" word"], dtype=np.object_)),
                pb_utils.Tensor("finish_reason", np.array([b"None" if left > 1 else b"length"], dtype=np.object_)),
                pb_utils.Tensor("num_input_tokens", np.array([512], dtype=np.uint32)),
                pb_utils.Tensor("num_output_tokens", np.array([1], dtype=np.uint32))])
            sender.send(response, flags=FINAL if left == 1 else 0)
            with self.lock:
                self.sent += 1
                self.last = time.perf_counter()
                self.cpu_s += time.thread_time() - cpu
            if left > 1:
                work.put((sender, left - 1))

    def execute(self, requests):
        for request in requests:
            value = {name: int(pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0])
                     for name in ("responses", "threads", "switch_interval_us")}
            sender = request.get_response_sender()
            if value["responses"] == 0:
                with self.lock:
                    span = (self.last - self.first) if self.sent and self.first is not None else 0.0
                    figures = {"sent": self.sent, "per_s": self.sent / span if span else None,
                               "cpu_us_per_send": self.cpu_s / self.sent * 1e6 if self.sent else None}
                    self._reset()
                text = np.array([json.dumps(figures).encode()], dtype=np.object_)
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", text)]),
                            flags=FINAL)
                continue
            interval_us = value["switch_interval_us"]
            self.busy = interval_us > 0
            sys.setswitchinterval(interval_us * 1e-6 if interval_us > 0 else self.default_interval)
            with self.lock:
                self.first = self.first if self.first is not None else time.perf_counter()
            self._pool(max(1, value["threads"])).put((sender, value["responses"]))
        return None
