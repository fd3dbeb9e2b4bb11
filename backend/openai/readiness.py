"""Whether this API can serve now: the Triton model is ready, and its engine answers.

Triton 2.51's python backend has no per-model readiness callback: a hung engine core leaves
Triton's /v2/health/ready and the model's ready at 200 until step_timeout_s (60 s) declares it
dead, and the only way for the model to say otherwise is to unload itself, far too heavy for a
stall that may pass. The model publishes how long its current step has run instead (the gauge
below, on Triton's metrics endpoint, refreshed every 0.5 s); this front's /health reads it and
turns 503 once a step has run past `unresponsive_after_s`, so a load balancer probing /health
stops routing here within seconds, and routes here again when the step ends or the core restarts."""

from __future__ import annotations

import asyncio
import re
import urllib.request

STEP_GAUGE = "deepseek:engine_step_running_seconds"
UNRESPONSIVE_AFTER_S = 5.0  # far above any step (a decode step takes milliseconds, a prefill chunk well under 1 s)
METRICS_TIMEOUT_S = 2.0
_SAMPLE = re.compile(rf"^{re.escape(STEP_GAUGE)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)


def step_running_s(metrics_text: str) -> float | None:
    """The longest running step among the gauge's samples (None: no gauge, e.g. the vLLM engine)."""
    values = [float(v) for v in _SAMPLE.findall(metrics_text)]
    return max(values) if values else None


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
        return response.read().decode("utf-8", "replace")


async def not_ready_because(model, metrics_url: str | None, unresponsive_after_s: float) -> str | None:
    """Why this API cannot serve now, or None when it can."""
    if not await model.ready():
        return "the Triton model is not ready"
    if not metrics_url or unresponsive_after_s <= 0:
        return None
    try:
        running = step_running_s(await asyncio.to_thread(_fetch, metrics_url))
    except OSError as e:  # Triton answered the readiness call: its metrics should answer too
        return f"Triton's metrics endpoint did not answer: {e}"
    if running is not None and running > unresponsive_after_s:
        return f"the engine is unresponsive: its current step has run for {running:.1f} s"
    return None
