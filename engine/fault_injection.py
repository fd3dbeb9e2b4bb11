"""Test-only fault injection: a runner wrapper, installed when EngineArgs.fault_injection_marker
is set (never in production; docs/RELIABILITY.md).

A request whose prompt holds the marker makes every forward it is in raise, after the forward
ran (the cache then holds half a step, the worst case); `<marker>:fatal` raises an error classed
as fatal; `<marker>:hang` blocks the forward until `hang_release` is set (at most HANG_RELEASE_S).
"""

from __future__ import annotations

import logging
import threading

from engine.request import GenerationRequest

log = logging.getLogger("deepseek.engine")

HANG_RELEASE_S = 120.0  # a "hung" step unblocks by itself after this long at most


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection (EngineArgs.fault_injection_marker)."""


class InjectedFatalFault(InjectedFault):
    """The injected stand-in for an error that leaves the device unusable (a CUDA error)."""


class FaultInjectingRunner:
    """Wraps a ModelRunner: `run` raises (or hangs) for the requests registered as faulty;
    everything else is the wrapped runner's."""

    def __init__(self, runner, marker: str):
        log.warning("fault injection is ON (fault_injection_marker=%r): for tests only", marker)
        self._runner, self.marker = runner, marker
        self.faults: dict[str, str] = {}  # request id -> "step" | "fatal" | "hang"
        self.hang_release = threading.Event()

    def register(self, request: GenerationRequest) -> None:
        prompt = request.prompt
        if prompt and self.marker in prompt:
            kinds = [k for k in ("fatal", "hang") if f"{self.marker}:{k}" in prompt]
            self.faults[request.request_id] = kinds[0] if kinds else "step"

    def forget(self, request_id: str) -> None:
        self.faults.pop(request_id, None)

    def run(self, scheduled, *args, **kwargs):
        logits = self._runner.run(scheduled, *args, **kwargs)
        for seq, _ in scheduled:
            kind = self.faults.get(seq.request_id)
            if kind == "hang":
                self.hang_release.wait(HANG_RELEASE_S)
                continue
            if kind == "fatal":
                raise InjectedFatalFault(f"injected fatal fault (request {seq.request_id})")
            if kind:
                raise InjectedFault(f"injected fault (request {seq.request_id})")
        return logits

    def __getattr__(self, name):  # graphs, replays_graph, ...: the wrapped runner's
        return getattr(self._runner, name)


def install(engine, marker: str | None) -> FaultInjectingRunner | None:
    """Wrap `engine.runner` when a marker is configured; the wrapper, or None."""
    if not marker:
        return None
    engine.runner = FaultInjectingRunner(engine.runner, marker)
    return engine.runner
