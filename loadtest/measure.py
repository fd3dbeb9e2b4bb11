"""Timing one streamed request, and the JSON-lines file of per-request records.

Shared by both load drivers (the Locust users in locustfile.py and the plain-thread reference in
threads.py), so their numbers mean the same thing:

- TTFT: request sent -> first delta that carries tokens.
- ITL: the gap between consecutive token-carrying deltas (one token each, from this engine).
- TPOT: (last token - first token) / (output tokens - 1), per request.
- E2E: request sent -> the stream's end.
- output_tokens: tokens of the deltas counted here (a delta's `num_output_tokens`, 1 for a delta
  with text but no count); server_num_output_tokens: the sum of what the server reported.
"""

from __future__ import annotations

import json
import os
import threading
import time

from client.types import Delta
from loadtest.workloads import Request

ERROR_BACKOFF_S = 0.2  # a user's pause after a failed request, so a dead server does not spin the CPU


class Measure:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.delta_ms: list[float] = []  # arrival of each token-carrying delta, since t0
        self.delta_tokens: list[int] = []
        self.server_tokens: int | None = None
        self.num_input_tokens: int | None = None
        self.finish_reason: str | None = None
        self.text: list[str] = []
        self.end: float | None = None

    def add(self, delta: Delta) -> None:
        now = time.perf_counter()
        tokens = delta.num_output_tokens
        if tokens is not None:
            self.server_tokens = (self.server_tokens or 0) + tokens
        if tokens or (tokens is None and delta.text):
            self.delta_ms.append((now - self.t0) * 1e3)
            self.delta_tokens.append(tokens if tokens is not None else 1)
        if delta.num_input_tokens is not None:
            self.num_input_tokens = delta.num_input_tokens
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        self.text.append(delta.text)

    def finish(self) -> None:
        self.end = time.perf_counter()

    @property
    def ttft_ms(self) -> float | None:
        return self.delta_ms[0] if self.delta_ms else None

    @property
    def e2e_ms(self) -> float:
        return ((self.end or time.perf_counter()) - self.t0) * 1e3

    @property
    def itl_ms(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_ms, self.delta_ms[1:])]

    @property
    def output_tokens(self) -> int:
        return sum(self.delta_tokens)

    def record(self, request: Request, error: BaseException | None, cancelled: bool) -> dict:
        """The request's JSON record. A stream that ended without a token is an error."""
        if self.end is None:
            self.finish()
        if error is None and not cancelled and not self.delta_ms:
            error = RuntimeError("the stream ended without any output token")
        n = self.output_tokens
        tpot = (self.delta_ms[-1] - self.delta_ms[0]) / (n - 1) if n > 1 else None
        rec = {
            "session": request.session, "turn": request.turn, "start": self.wall0,
            "ok": error is None and not cancelled, "cancelled": cancelled,
            "error": None if error is None else f"{type(error).__name__}: {error}"[:500],
            "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms, "tpot_ms": tpot,
            "output_tokens": n, "server_num_output_tokens": self.server_tokens, "deltas": len(self.delta_ms),
            "max_tokens": request.max_tokens, "finish_reason": self.finish_reason,
            "prompt_tokens": request.prompt_tokens, "num_input_tokens": self.num_input_tokens,
            "delta_ms": [round(t, 3) for t in self.delta_ms],
        }
        if any(k != 1 for k in self.delta_tokens):
            rec["delta_tokens"] = self.delta_tokens
        return rec


class RecordWriter:
    """JSON lines: {"kind": "request", ...} per request, {"kind": "start"|"stopping"|"stop", "t"}
    marks for the run window, and at "stopping" {"kind": "cpu", "pid", "cpu_s", "wall_s"}: this
    process's CPU over the window (loadtest.saturation). Flushed per line, so a killed run still
    leaves its records."""

    def __init__(self, path: str | None):
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (close())
        self.lock = threading.Lock()  # the thread driver writes from many threads
        self.clocks: tuple[float, float] | None = None  # (wall, CPU) at "start"

    def write(self, kind: str, **fields) -> None:
        if self.file is None:
            return
        line = json.dumps({"kind": kind, **fields}) + "\n"
        with self.lock:
            self.file.write(line)
            self.file.flush()

    def mark(self, kind: str) -> None:
        now = time.time()
        self.write(kind, t=now)
        if kind == "start":
            self.clocks = (now, time.process_time())
        elif kind == "stopping" and self.clocks is not None:
            wall0, cpu0 = self.clocks
            self.write("cpu", pid=os.getpid(), cpu_s=time.process_time() - cpu0, wall_s=now - wall0)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
