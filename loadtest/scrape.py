"""What the server saw during a load level: Triton's metrics endpoint read before and after.

The native engine's counters (docs/USAGE.md, backend/metrics.py) give the prefix-cache hit ratio
(`deepseek:prefix_cache_hit_tokens_total / deepseek:prefix_cache_queries_total`), replayed tokens,
preemptions, speculative decoding's draft and accepted tokens (acceptance rate, mean acceptance
length), and the server's own request and token totals to check the client's against; the
response thread's counters say whether the server's Python, not the engine, was the limit
(deltas per streamed response above 1, the thread busy near 100%).
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request

# counter families summed over their labels; request_success is also kept per finish reason
COUNTERS = {
    "deepseek:prefix_cache_queries_total": "prefix_cache_queries",
    "deepseek:prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
    "deepseek:replayed_tokens_total": "replayed_tokens",
    "deepseek:num_preemptions_total": "num_preemptions",
    "deepseek:prompt_tokens_total": "prompt_tokens",
    "deepseek:generation_tokens_total": "generation_tokens",
    "deepseek:request_success_total": "requests_finished",
    "deepseek:stream_deltas_total": "stream_deltas",
    "deepseek:stream_responses_total": "stream_responses",
    "deepseek:response_thread_cpu_seconds_total": "response_thread_cpu_s",
    "deepseek:spec_decode_num_drafts_total": "spec_decode_num_drafts",
    "deepseek:spec_decode_num_draft_tokens_total": "spec_decode_num_draft_tokens",
    "deepseek:spec_decode_num_accepted_tokens_total": "spec_decode_num_accepted_tokens",
    "nv_inference_request_failure": "triton_request_failures",
}
# the engine-stats counters are polled every 0.5 s (backend/metrics.py): wait this long for them
SETTLE_S = 1.5

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {short name: sum over labels}, plus `requests_finished/<reason>`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in COUNTERS:
            continue
        name = COUNTERS[m.group(1)]
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
        labels = dict(_LABEL.findall(m.group(3) or ""))
        if "finished_reason" in labels:
            key = f"{name}/{labels['finished_reason']}"
            out[key] = out.get(key, 0.0) + value
    return out


def metric(text: str, name: str, **labels) -> float | None:
    """Sum of the samples of family `name` whose labels include `labels` (None: no such sample)."""
    total = None
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        found = dict(_LABEL.findall(m.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(4))
    return total


def metrics_text(url: str, timeout_s: float = 5.0) -> str:
    """The Prometheus text at `url` (raises when it cannot be read)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8", "replace")


def gpu_count(text: str) -> int | None:
    """GPUs Triton reports (distinct `gpu_uuid` of nv_gpu_utilization): every GPU the server can see,
    which is the serving count on a dedicated host. None: no GPU in the metrics."""
    uuids = {dict(_LABEL.findall(m.group(3) or "")).get("gpu_uuid") for m in map(_SAMPLE.match, text.splitlines())
             if m and m.group(1) == "nv_gpu_utilization"}
    return len(uuids - {None}) or None


def scrape(url: str | None, timeout_s: float = 5.0) -> dict[str, float] | None:
    """None when there is no metrics URL or it cannot be read (the sweep carries on without it)."""
    if not url:
        return None
    try:
        return parse(metrics_text(url, timeout_s))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """Counter increase over a level, and the prefix-cache hit ratio the server saw."""
    if before is None or after is None:
        return None
    out = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    queries = out.get("prefix_cache_queries", 0.0)
    out["prefix_hit_ratio"] = out.get("prefix_cache_hit_tokens", 0.0) / queries if queries else None
    # above 1: the server's response thread fell behind and merged deltas (backend/model.py)
    responses = out.get("stream_responses", 0.0)
    out["deltas_per_response"] = out.get("stream_deltas", 0.0) / responses if responses else None
    # speculative decoding over the level (vLLM's acceptance rate and mean acceptance length)
    drafts, tokens = out.get("spec_decode_num_drafts", 0.0), out.get("spec_decode_num_draft_tokens", 0.0)
    accepted = out.get("spec_decode_num_accepted_tokens", 0.0)
    out["spec_acceptance_rate"] = accepted / tokens if tokens else None
    out["spec_mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return out
