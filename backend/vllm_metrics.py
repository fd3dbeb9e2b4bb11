"""vLLM's metric families (`vllm:` prefix, `model_name` label, vLLM v1's types and buckets), fed
from the same per-request records and polled engine stats as backend/metrics.py's, so vLLM's
Grafana dashboard, autoscalers and routers that read `vllm:num_requests_waiting` or
`vllm:kv_cache_usage_perc` work unchanged.

The queue / prefill / inference times run from when the engine first scheduled the request
(RequestOutput.scheduled_time, on the host's monotonic clock); the token times are when the front
received them. `iteration_tokens_total` (tokens scheduled per step) is rebuilt from the engine's
polled per-power-of-two step counts and token sums: vLLM's buckets are powers of two, so each
bucket's count and the histogram's sum come out exact."""

from __future__ import annotations

PREFIX = "vllm:"

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# engine.stats() key (cumulative) -> vLLM's counter
STAT_COUNTERS = {
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hit_tokens": "prefix_cache_hits_total",
    "num_preemptions": "num_preemptions_total",
    "spec_decode_num_drafts": "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens_total",
}


class VllmFamilies:
    """The families, made through `family(name, description, kind)` (backend/metrics.py's maker)."""

    def __init__(self, family, kinds, model_name: str, token_buckets: list[float]):
        self.labels = {"model_name": model_name}

        def histogram(name, description, buckets):
            return family(PREFIX + name, description, kinds.HISTOGRAM).Metric(labels=self.labels, buckets=buckets)

        def metric(name, description, kind):
            return family(PREFIX + name, description, kind).Metric(labels=self.labels)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (inter_token_latency_seconds' "
                              "older name, which vLLM's dashboard reads).", ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_TIME_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_len = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                        token_buckets)
        self.max_generation = histogram("request_max_num_generation_tokens",
                                        "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.prompt_tokens = metric("prompt_tokens_total", "Number of prefill tokens processed.", kinds.COUNTER)
        self.generation_tokens = metric("generation_tokens_total", "Number of generation tokens processed.",
                                        kinds.COUNTER)
        self.success_family = family(PREFIX + "request_success_total", "Count of successfully processed requests.",
                                     kinds.COUNTER)
        self.success: dict[str, object] = {}
        self.running = metric("num_requests_running", "Number of requests in model execution batches.", kinds.GAUGE)
        self.waiting = metric("num_requests_waiting", "Number of requests waiting to be processed.", kinds.GAUGE)
        self.kv_usage = metric("kv_cache_usage_perc",
                               "KV-cache usage. 1 means 100 percent usage (the fullest pool's).", kinds.GAUGE)
        self.counters = {key: metric(name, f"{name} (vLLM's).", kinds.COUNTER) for key, name in STAT_COUNTERS.items()}
        self.last = dict.fromkeys(self.counters, 0.0)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.last_steps: list[list[int]] = []  # the engine's iteration_tokens at the last poll

    def observe(self, r) -> None:
        """One finished request (backend/metrics.py's RequestRecord)."""
        if r.ttft_s is not None:
            self.ttft.observe(r.ttft_s)
        for gap in r.itl_s:
            self.itl.observe(gap)
            self.tpot.observe(gap)
        if r.decode_s is not None:
            self.decode.observe(r.decode_s)
            if r.num_output_tokens > 1:
                self.request_tpot.observe(r.decode_s / (r.num_output_tokens - 1))
        for histogram, seconds in ((self.queue, r.queue_s), (self.prefill, r.prefill_s),
                                   (self.inference, r.inference_s)):
            if seconds is not None:
                histogram.observe(seconds)
        self.e2e.observe(r.e2e_s)
        self.prompt_len.observe(r.num_prompt_tokens)
        self.generation_len.observe(r.num_output_tokens)
        if r.max_tokens is not None:
            self.max_generation.observe(r.max_tokens)
        self.prompt_tokens.increment(r.num_prompt_tokens)
        self.generation_tokens.increment(r.num_output_tokens)
        if r.finish_reason not in self.success:
            self.success[r.finish_reason] = self.success_family.Metric(
                labels={**self.labels, "finished_reason": r.finish_reason})
        self.success[r.finish_reason].increment(1)

    def poll(self, stats: dict) -> None:
        self.running.set(float(stats.get("running", 0)))
        self.waiting.set(float(stats.get("waiting", 0)))
        kv = stats.get("kv_usage", {})
        self.kv_usage.set(float(max(kv.values(), default=0.0) if isinstance(kv, dict) else kv))
        for key, counter in self.counters.items():
            value = float(stats.get(key, 0))
            delta = value if value < self.last[key] else value - self.last[key]  # a restarted engine counts anew
            if delta > 0:
                counter.increment(delta)
            self.last[key] = value
        self._observe_steps(stats.get("iteration_tokens"))

    def _observe_steps(self, steps) -> None:
        """The engine's [steps, tokens] per power-of-two bucket (2^(k-1) < tokens <= 2^k at index k),
        cumulative: each new step observed at its bucket's mean, which lies in the same vLLM bucket."""
        if not isinstance(steps, list):
            return
        last = self.last_steps
        if len(last) != len(steps) or any(s[0] < old[0] for s, old in zip(steps, last)):
            last = [[0, 0]] * len(steps)  # a restarted engine counts anew
        for (count, tokens), (old_count, old_tokens) in zip(steps, last):
            if count > old_count:
                mean = (tokens - old_tokens) / (count - old_count)
                for _ in range(count - old_count):
                    self.iteration_tokens.observe(mean)
        self.last_steps = [list(s) for s in steps]
