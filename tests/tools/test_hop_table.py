"""tools/hop_table.py on hand-made marks: a response that carries several tokens counts each of them
from the step that made it, and the marks the processes write (engine/hop_trace.py) load back whole."""

from __future__ import annotations

import importlib

import pytest

from tools import hop_table


def _request():
    """Three tokens; the core sends them in steps at 10, 20 and 30 ms, the client gets token 1 alone
    and tokens 2-3 in one response (the response thread fell behind)."""
    ms = 1e-3
    return [("client_sent", 0, 0.0), ("execute", 0, 1 * ms), ("submitted", 0, 2 * ms), ("core_received", 0, 3 * ms),
            ("core_sent", 1, 10 * ms), ("core_sent", 2, 20 * ms), ("core_sent", 3, 30 * ms),
            ("client_received", 1, 11 * ms), ("client_received", 3, 35 * ms)]


def test_a_merged_response_counts_each_token_from_its_own_step():
    times = hop_table.token_times(_request(), 3)
    assert times["core_sent"] == pytest.approx([0.010, 0.020, 0.030])
    assert times["client_received"] == pytest.approx([0.011, 0.035, 0.035])
    assert times["execute"] == pytest.approx([0.001] * 3)  # admission: once per request
    assert times["read"] == [None] * 3  # not marked on this path

    result = hop_table.table([times])
    assert result["first_token"]["core_received -> core_sent"]["p50"] == pytest.approx(7.0)
    assert result["first_token"]["core_sent -> client_received"]["p50"] == pytest.approx(1.0)
    later = result["later_tokens"]["core_sent -> client_received"]
    assert later["n"] == 2 and later["p50"] == pytest.approx(10.0)  # token 2 waited for token 3
    assert "core_received -> core_sent" not in result["later_tokens"]
    assert result["totals"]["TTFT outside the engine"]["p50"] == pytest.approx(11.0 - 7.0)


def test_the_trace_writes_one_line_per_request_per_process(tmp_path, monkeypatch):
    from engine import hop_trace

    monkeypatch.setenv(hop_trace.ENV, str(tmp_path / "trace"))
    trace = importlib.reload(hop_trace)
    try:
        trace.mark("req-1", "execute", t=1.0)
        trace.mark("req-1", "sent", 1, t=2.0)
        trace.done("req-1")
        trace.done("never-marked")
    finally:
        monkeypatch.delenv(hop_trace.ENV)
        importlib.reload(hop_trace)
    assert hop_table.load(str(tmp_path / "trace")) == {"req-1": [("execute", 0, 1.0), ("sent", 1, 2.0)]}
    assert not hop_trace.enabled()
