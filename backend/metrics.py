"""Custom Prometheus families on Triton's metrics endpoint (:8002/metrics), via pb_utils.MetricFamily:
vLLM's (`vllm:`, backend/vllm_metrics.py) and ours (`deepseek:`, kept one release for the tools and
dashboards that read them; `vllm:` is the set to use).

Per-request figures (latencies, lengths, finish reasons) come from backend/model.py when a request
finishes; engine-wide figures (running/waiting requests, KV-cache usage, prefix-cache and replay
counters, speculative decoding's drafts and acceptance) are polled from `engine.stats()`. Every
metric call is an IPC to the Triton process, so one thread does them all, off the engine's event
loop. Triton 2.51's python backend supports HISTOGRAM (python_backend >= 24.08), so histograms
are real Prometheus histograms.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from backend.vllm_metrics import VllmFamilies
from engine.os_threads import named

PREFIX = "deepseek:"
POLL_INTERVAL_S = 0.5

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0]


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


# engine.stats() key (cumulative) -> counter family and description
STAT_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache."),
    "prefix_cache_replayed_tokens": ("replayed_tokens_total",
                                     "Tokens recomputed by SWA bounded replay after prefix-cache hits."),
    "num_preemptions": ("num_preemptions_total", "Requests preempted (their KV freed, recomputed later)."),
    # speculative decoding (vLLM's names): verify steps (one per request and step), drafts, accepted
    "spec_decode_num_drafts": ("spec_decode_num_drafts_total", "Draft proposals verified (one per request and step)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens_total", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
    "spec_decode_num_steps_without_verify": ("spec_decode_num_steps_without_verify_total",
                                             "Speculative steps in which no sequence verified drafts (plain steps)."),
    "spec_decode_num_backoffs": ("spec_decode_num_backoffs_total",
                                 "Times a sequence stopped verifying: its mean accepted length fell below break-even."),
    "spec_decode_num_confidence_skips": ("spec_decode_num_confidence_skips_total",
                                         "DSpark blocks the confidence head chose not to verify at all."),
    "num_step_failures": ("engine_step_failures_total",
                          "Engine steps that raised (the failing request is isolated and failed)."),
    # from model.py's response thread, not the engine
    "stream_deltas": ("stream_deltas_total", "Engine deltas of streaming requests (usually one token each)."),
    "stream_responses": ("stream_responses_total",
                         "Streamed responses sent: below stream_deltas_total when the response thread "
                         "fell behind and sent the deltas that piled up for a request as one."),
    "response_thread_cpu_s": ("response_thread_cpu_seconds_total",
                              "CPU time of the thread that renders and sends responses; a rate near 1 "
                              "means it is the server's bottleneck."),
}
# Triton error codes the backend sends (model.py), as labels of request_failure_total
ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED")


@dataclass
class RequestRecord:
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str
    ttft_s: float | None
    e2e_s: float
    decode_s: float | None  # first token -> last token
    itl_s: list[float] = field(default_factory=list)  # the gaps between the deltas that brought tokens
    max_tokens: int | None = None  # what the request asked for at most
    # vLLM's request phases, from when the engine first scheduled the request (None: not known)
    queue_s: float | None = None  # arrival -> first scheduled
    prefill_s: float | None = None  # first scheduled -> first token
    inference_s: float | None = None  # first scheduled -> last token


@dataclass
class TokenTimes:
    """When a request's tokens reached the model (time.monotonic()): the first, the last, and the
    gaps vLLM's inter-token histograms take. A gap is counted per delta that starts a response: per
    engine step while the response threads keep up; the deltas they merge into one response make
    one gap, the one its client sees. Every observation is an IPC to the Triton process (and a turn
    of its one stub-message thread, which also passes every response send on), so their number
    follows the responses sent, which the stub can bound, not the engine's token rate."""

    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    gap_from: float | None = None  # when the last counted gap ended

    def arrived(self, now: float, starts_response: bool = True) -> None:
        if self.first is None:
            self.first = self.gap_from = now
        elif starts_response:
            self.gaps.append(now - self.gap_from)
            self.gap_from = now
        self.last = now


def scheduling_times(arrival: float, scheduled: float | None, first_token: float | None,
                     last_token: float | None) -> dict[str, float]:
    """RequestRecord's queue / prefill / inference times (time.monotonic() readings, one host's
    clock); empty when the engine did not say when it scheduled the request."""
    if scheduled is None:
        return {}
    times = {"queue_s": max(scheduled - arrival, 0.0)}
    if first_token is not None:
        times["prefill_s"] = max(first_token - scheduled, 0.0)
        times["inference_s"] = max(last_token - scheduled, 0.0)
    return times


def gauges_from_stats(stats: dict) -> tuple[dict[str, float], dict[str, float]]:
    """engine.stats() -> (gauges, cumulative counters) by metric name (kv usage: one per pool)."""
    gauges = {
        "num_requests_running": float(stats.get("running", 0)),
        "num_requests_waiting": float(stats.get("waiting", 0)),
        "engine_step_running_seconds": float(stats.get("step_running_s", 0.0)),
    }
    kv = stats.get("kv_usage", {})
    if isinstance(kv, dict):
        for pool, usage in kv.items():
            gauges[f"kv_cache_usage_perc/{pool}"] = float(usage)
    else:
        gauges["kv_cache_usage_perc/all"] = float(kv)
    for pool, blocks in (stats.get("kv_blocks") or {}).items():  # the native engine's
        if isinstance(blocks, dict) and {"free", "total"} <= blocks.keys():
            gauges[f"kv_cache_free_blocks/{pool}"] = float(blocks["free"])
            gauges[f"kv_cache_blocks/{pool}"] = float(blocks["total"])
    counters = {name: float(stats.get(key, 0)) for key, (name, _) in STAT_COUNTERS.items()}
    if "spec_decode_num_draft_tokens" in stats:
        gauges["spec_decode_draft_acceptance_rate"] = float(stats.get("spec_decode_acceptance_rate", 0.0))
        gauges["spec_decode_mean_acceptance_length"] = float(stats.get("spec_decode_mean_acceptance_length", 0.0))
        for pos, n in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or []):
            counters[f"{PER_POS}/{pos}"] = float(n)
        # the accepted-length histogram: verifies by tokens they emitted (accepted drafts + 1)
        for a, n in enumerate(stats.get("spec_decode_accepted_length_counts") or []):
            counters[f"{ACCEPTED_LENGTH}/{a + 1}"] = float(n)
        for i, n in enumerate(stats.get("spec_decode_dspark_chosen_length_counts") or []):
            counters[f"{CHOSEN_LENGTH}/{i + 1}"] = float(n)
    return gauges, counters


PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"  # labelled by draft position
ACCEPTED_LENGTH = "spec_decode_accepted_length_total"  # labelled by tokens per verify
CHOSEN_LENGTH = "spec_decode_dspark_chosen_length_total"  # labelled by the drafts the confidence head chose
LABELLED = {  # counter families with one labelled counter per "<family>/<label value>" key
    PER_POS: ("position", "Draft tokens accepted, by position in the draft (0: the first)."),
    ACCEPTED_LENGTH: ("length", "Verify steps, by the tokens they emitted (accepted drafts + 1): the accepted-length histogram."),
    CHOSEN_LENGTH: ("length", "DSpark blocks, by the number of drafts the confidence head chose to verify."),
}


class Metrics:
    """Owns the families and the thread that updates them."""

    def __init__(self, labels: dict, stats_fn, max_model_len: int, poll_interval_s: float = POLL_INTERVAL_S,
                 model_name: str | None = None):
        self.labels = dict(labels)
        self.stats_fn = stats_fn
        self.poll_interval_s = poll_interval_s
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=named("ds-metrics", self._loop), name="deepseek-metrics", daemon=True)
        self.stats_errors = 0

        F = pb_utils.MetricFamily
        self.families = []

        def named_family(full_name, description, kind):
            self.families.append(F(name=full_name, description=description, kind=kind))
            return self.families[-1]

        def family(name, description, kind):
            return named_family(PREFIX + name, description, kind)

        def histogram(name, description, buckets):
            return family(name, description, F.HISTOGRAM).Metric(labels=self.labels, buckets=buckets)

        token_buckets = buckets_1_2_5(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, in seconds.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests in tokens.",
                                    token_buckets)
        self.generation_len = histogram("request_generation_tokens",
                                        "Generated length of finished requests in tokens.", token_buckets)
        self.prompt_tokens = family("prompt_tokens_total", "Prompt tokens of finished requests.",
                                    F.COUNTER).Metric(labels=self.labels)
        self.generation_tokens = family("generation_tokens_total", "Generated tokens of finished requests.",
                                        F.COUNTER).Metric(labels=self.labels)
        self.success_family = family("request_success_total", "Finished requests by finish reason.", F.COUNTER)
        self.success: dict[str, object] = {}
        failure_family = family("request_failure_total",
                                "Requests answered with an error, by Triton error code.", F.COUNTER)
        self.failures = {code: failure_family.Metric(labels={**self.labels, "code": code}) for code in ERROR_CODES}

        self.stat_counters = {name: family(name, description, F.COUNTER).Metric(labels=self.labels)
                              for name, description in STAT_COUNTERS.values()}
        self.last_counter_values = dict.fromkeys(self.stat_counters, 0.0)
        self.labelled_families = {name: family(name, description, F.COUNTER)
                                  for name, (_, description) in LABELLED.items()}
        self.gauge_families = {
            "num_requests_running": family("num_requests_running", "Requests running in the engine.", F.GAUGE),
            "num_requests_waiting": family("num_requests_waiting", "Requests waiting in the engine.", F.GAUGE),
            "engine_step_running_seconds": family(
                "engine_step_running_seconds", "How long the engine step now running has run (0: idle); past a "
                "few seconds the engine is unresponsive (the OpenAI API's /health turns 503).", F.GAUGE),
            "kv_cache_usage_perc": family("kv_cache_usage_perc", "KV-cache block usage per pool; 1 is full.",
                                          F.GAUGE),
            "kv_cache_free_blocks": family("kv_cache_free_blocks", "Free KV-cache blocks per pool.", F.GAUGE),
            "kv_cache_blocks": family("kv_cache_blocks", "KV-cache blocks per pool.", F.GAUGE),
            "spec_decode_draft_acceptance_rate": family(
                "spec_decode_draft_acceptance_rate", "Accepted / verified draft tokens since start.", F.GAUGE),
            "spec_decode_mean_acceptance_length": family(
                "spec_decode_mean_acceptance_length",
                "Tokens per verify step (1 + accepted drafts per proposal) since start.", F.GAUGE),
        }
        self.gauges: dict[str, object] = {}
        self.vllm = None if model_name is None else VllmFamilies(named_family, F, model_name, token_buckets)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)

    def record(self, record: RequestRecord) -> None:
        self.queue.put(record)

    def record_error(self, code: str) -> None:
        """One request answered with an error (`code`: a pb_utils.TritonError code name)."""
        self.queue.put(("error", code))

    # ------------------------------------------------------------------ metrics thread

    def _loop(self) -> None:
        # first poll one period in: its metric IPC then never overlaps the model's initialize
        # handshake (a start-up once hung there, under heavy load, with the poll at once)
        next_poll = time.monotonic() + self.poll_interval_s
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ...
            if item is None:
                return
            if isinstance(item, RequestRecord):
                self._observe(item)
            elif isinstance(item, tuple) and item[1] in self.failures:
                self.failures[item[1]].increment(1)
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self.poll_interval_s

    def _observe(self, r: RequestRecord) -> None:
        if r.ttft_s is not None:
            self.ttft.observe(r.ttft_s)
        if r.decode_s is not None and r.num_output_tokens > 1:
            self.tpot.observe(r.decode_s / (r.num_output_tokens - 1))
        self.e2e.observe(r.e2e_s)
        self.prompt_len.observe(r.num_prompt_tokens)
        self.generation_len.observe(r.num_output_tokens)
        self.prompt_tokens.increment(r.num_prompt_tokens)
        self.generation_tokens.increment(r.num_output_tokens)
        if r.finish_reason not in self.success:
            labels = {**self.labels, "finished_reason": r.finish_reason}
            self.success[r.finish_reason] = self.success_family.Metric(labels=labels)
        self.success[r.finish_reason].increment(1)
        if self.vllm is not None:
            self.vllm.observe(r)

    def _poll(self) -> None:
        try:
            stats = self.stats_fn()
            gauges, counters = gauges_from_stats(stats)
        except Exception:
            self.stats_errors += 1  # the engine may be gone (shutdown); keep the last values
            return
        if self.vllm is not None:
            self.vllm.poll(stats)
        for key, value in gauges.items():
            name, _, pool = key.partition("/")
            if key not in self.gauges:
                labels = {**self.labels, "pool": pool} if pool else self.labels
                self.gauges[key] = self.gauge_families[name].Metric(labels=labels)
            self.gauges[key].set(value)
        for name, value in counters.items():
            if name not in self.stat_counters:  # <family>/<value>: one labelled counter per value (LABELLED)
                fam, _, label = name.partition("/")
                self.stat_counters[name] = self.labelled_families[fam].Metric(
                    labels={**self.labels, LABELLED[fam][0]: label})
                self.last_counter_values[name] = 0.0
            delta = value - self.last_counter_values[name]
            if delta < 0:  # the engine's counter restarted
                delta = value
            if delta > 0:
                self.stat_counters[name].increment(delta)
            self.last_counter_values[name] = value
