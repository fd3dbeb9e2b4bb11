"""The launcher's watch over a running tritonserver (and the OpenAI front beside it, restarted the
same way when it exits): when it dies (one crafted HTTP body makes
Triton's JSON parser overflow its stack: docs/RELIABILITY.md) or its model stops being ready (the
engine died and the backend unloaded it), everything of it is removed (backend.process_tree), the
reason is logged, and it is started again with exponential backoff. A server that stays ready for
`stable_s` earns its backoff back; `max_restarts` failures in a row end the launcher with exit 1,
as does every failure when restarts are off (`--no-restart`: an orchestrator restarts instead)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.openai.process import OpenAIProcess
    from backend.serve import TritonServer

POLL_S = 1.0


@dataclass
class RestartPolicy:
    enabled: bool = True
    max_restarts: int = 10  # failures in a row (a stable run resets the count)
    backoff_s: float = 1.0  # first wait; doubles per failure in a row
    max_backoff_s: float = 60.0
    stable_s: float = 300.0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def why_down(server: TritonServer, not_ready: int) -> str | None:
    """None while the server serves; else why it must be restarted."""
    if server.process is None or server.process.poll() is not None:
        code = None if server.process is None else server.process.returncode
        return f"tritonserver died ({describe_exit(code)})"
    if not_ready >= 2:
        return f"model(s) {', '.join(server.model_names())} no longer ready"
    return None


class FrontWatch:
    """The OpenAI front beside tritonserver, watched on the same poll: when it exits it is logged
    and started again after the policy's backoff (Triton serves on meanwhile). Past the policy
    (`max_restarts` failures in a row, or any with --no-restart) it gives up and the launcher
    exits 1 as it does for tritonserver."""

    def __init__(self, front: OpenAIProcess, policy: RestartPolicy):
        self.front, self.policy = front, policy
        self.failures = 0
        self.next_try = 0.0
        self.given_up = False

    def check(self) -> None:
        process = self.front.process
        if self.given_up or (process is not None and process.poll() is None):
            return
        if process is not None:
            _log(f"error: the OpenAI API died ({describe_exit(process.returncode)}); log {self.front.log_path}")
            self.front.process = None
            self._failed()
        if not self.policy.enabled or self.given_up or time.monotonic() < self.next_try:
            return
        try:
            self.front.start()
        except RuntimeError as e:
            _log(f"error: restarting the OpenAI API failed: {e}")
            self._failed()
            return
        self.failures = 0
        _log(f"the OpenAI API restarted: {self.front.base_url}")

    def _failed(self) -> None:
        self.failures += 1
        if not self.policy.enabled or self.failures > self.policy.max_restarts:
            self.given_up = True
            _log("not restarting the OpenAI API: " + ("--no-restart" if not self.policy.enabled else
                                                      f"{self.policy.max_restarts} restarts in a row failed"))
            return
        wait_s = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** (self.failures - 1))
        self.next_try = time.monotonic() + wait_s
        _log(f"restarting the OpenAI API in {wait_s:.0f} s (failure {self.failures} in a row)")


def supervise(server: TritonServer, stop: threading.Event, policy: RestartPolicy,
              front: OpenAIProcess | None = None) -> int:
    """Watch `server` (started) and the OpenAI `front` beside it until `stop` is set (returns 0
    after a graceful stop) or the server fails beyond the policy (returns 1)."""
    front_watch = FrontWatch(front, policy) if front is not None else None
    failures = 0
    restarts = 0
    ready_since = time.monotonic()
    not_ready = 0
    while True:
        stop.wait(POLL_S)
        if stop.is_set():
            print("stopping tritonserver ...", flush=True)
            server.stop()
            return 0
        server.record_processes()
        if front_watch is not None:
            front_watch.check()
            if front_watch.given_up:
                server.stop()
                return 1
        not_ready = 0 if server.models_ready() else not_ready + 1
        reason = why_down(server, not_ready)
        if reason is None:
            if failures and time.monotonic() - ready_since >= policy.stable_s:
                failures = 0
            continue
        tail = server.log_tail()
        if server.process is not None and server.process.poll() is None:
            server.stop()  # alive but its model is gone: a graceful stop first
        else:
            server.reap()
        _log(f"error: {reason}. Last log lines:\n{tail}")
        if server.leftovers.get("killed") or server.leftovers.get("removed_regions"):
            _log(f"cleaned up after it: {server.leftovers}")
        failures += 1
        if not policy.enabled or failures > policy.max_restarts:
            _log("not restarting: " + ("--no-restart" if not policy.enabled else
                                       f"{policy.max_restarts} restarts in a row failed"))
            return 1
        while True:
            wait_s = min(policy.max_backoff_s, policy.backoff_s * 2 ** (failures - 1))
            _log(f"restarting tritonserver in {wait_s:.0f} s (failure {failures} in a row)")
            if stop.wait(wait_s):
                server.stop()
                return 0
            restarts += 1
            try:
                server.start(restart=restarts)
                break
            except Exception as e:  # a start that fails for any reason is a failed restart
                _log(f"error: restart {restarts} failed: {e}")
                failures += 1
                if failures > policy.max_restarts:
                    _log(f"not restarting: {policy.max_restarts} restarts in a row failed")
                    return 1
        _log(f"tritonserver restarted (restart {restarts}); serving again")
        ready_since = time.monotonic()
        not_ready = 0
