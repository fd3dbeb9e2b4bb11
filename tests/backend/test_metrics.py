"""backend/metrics.py with a stand-in for pb_utils' MetricFamily (the real one lives in the stub;
the server tests scrape the real thing)."""

import sys
import time
import types

import pytest


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        assert (buckets is not None) == (self.kind == "histogram")
        self.metrics.append(FakeMetric(labels, buckets))
        return self.metrics[-1]


@pytest.fixture
def metrics_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=FakeFamily))
    monkeypatch.delitem(sys.modules, "backend.metrics", raising=False)
    import backend.metrics

    yield backend.metrics
    sys.modules.pop("backend.metrics", None)


def test_buckets_1_2_5(metrics_module):
    assert metrics_module.buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_requests_and_polled_stats_reach_the_families(metrics_module):
    stats = iter([
        {"running": 2, "waiting": 1, "kv_usage": {"swa": 0.5, "compressed": 0.25}, "prefix_cache_hit_tokens": 10},
        {"running": 0, "waiting": 0, "kv_usage": {"swa": 0.0, "compressed": 0.0}, "prefix_cache_hit_tokens": 30,
         "prefix_cache_replayed_tokens": 16, "prefix_cache_queries": 40, "step_running_s": 2.5},
    ])
    m = metrics_module.Metrics({"model": "m", "version": "1"}, lambda: next(stats), 1024, poll_interval_s=0.05)
    m.start()
    m.record(metrics_module.RequestRecord(num_prompt_tokens=7, num_output_tokens=5, finish_reason="length",
                                          ttft_s=0.2, e2e_s=0.6, decode_s=0.4))
    time.sleep(0.3)
    m.stop()
    fam = FakeFamily.created
    assert fam["deepseek:time_to_first_token_seconds"].metrics[0].observed == [0.2]
    assert fam["deepseek:time_per_output_token_seconds"].metrics[0].observed == [pytest.approx(0.1)]
    assert fam["deepseek:prompt_tokens_total"].metrics[0].value == 7
    success = fam["deepseek:request_success_total"].metrics[0]
    assert success.labels["finished_reason"] == "length" and success.value == 1
    pools = {g.labels["pool"]: g.value for g in fam["deepseek:kv_cache_usage_perc"].metrics}
    assert pools == {"swa": 0.0, "compressed": 0.0}
    assert fam["deepseek:prefix_cache_hit_tokens_total"].metrics[0].value == 30  # cumulative, not 10 + 30
    assert fam["deepseek:replayed_tokens_total"].metrics[0].value == 16
    assert fam["deepseek:prefix_cache_queries_total"].metrics[0].value == 40
    assert fam["deepseek:num_preemptions_total"].metrics[0].value == 0
    assert fam["deepseek:num_requests_running"].metrics[0].value == 0
    assert fam["deepseek:engine_step_running_seconds"].metrics[0].value == 2.5  # the OpenAI front's readiness reads it


def test_speculative_decoding_stats_reach_vllms_families(metrics_module):
    base = {"running": 1, "waiting": 0, "kv_usage": {}}
    stats = iter([
        {**base, "spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 5,
         "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0], "spec_decode_acceptance_rate": 5 / 12,
         "spec_decode_mean_acceptance_length": 1 + 5 / 4},
        {**base, "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 9,
         "spec_decode_num_accepted_tokens_per_pos": [6, 2, 1], "spec_decode_acceptance_rate": 0.3,
         "spec_decode_mean_acceptance_length": 1.9, "spec_decode_accepted_length_counts": [4, 4, 1, 1],
         "spec_decode_dspark_chosen_length_counts": [0, 1, 2, 3, 4]},
    ])
    m = metrics_module.Metrics({"model": "m", "version": "1"}, lambda: next(stats), 1024, poll_interval_s=0.05)
    m.start()
    time.sleep(0.3)
    m.stop()
    fam = FakeFamily.created
    assert fam["deepseek:spec_decode_num_drafts_total"].metrics[0].value == 10
    assert fam["deepseek:spec_decode_num_draft_tokens_total"].metrics[0].value == 30
    assert fam["deepseek:spec_decode_num_accepted_tokens_total"].metrics[0].value == 9
    per_pos = {c.labels["position"]: c.value for c in fam["deepseek:spec_decode_num_accepted_tokens_per_pos_total"].metrics}
    assert per_pos == {"0": 6, "1": 2, "2": 1}
    lengths = {c.labels["length"]: c.value for c in fam["deepseek:spec_decode_accepted_length_total"].metrics}
    assert lengths == {"1": 4, "2": 4, "3": 1, "4": 1}  # appeared at the second poll: its whole value counts
    chosen = {c.labels["length"]: c.value for c in fam["deepseek:spec_decode_dspark_chosen_length_total"].metrics}
    assert chosen == {"1": 0, "2": 1, "3": 2, "4": 3, "5": 4}
    assert fam["deepseek:spec_decode_draft_acceptance_rate"].metrics[0].value == 0.3
    assert fam["deepseek:spec_decode_mean_acceptance_length"].metrics[0].value == 1.9


# The metric names vLLM's Grafana dashboard queries (vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json).
VLLM_DASHBOARD = {"vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens",
                  "vllm:request_generation_tokens", "vllm:request_success_total", "vllm:request_queue_time_seconds",
                  "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                  "vllm:request_max_num_generation_tokens"}


def test_vllms_families_per_token_itl_and_the_dashboards_names(metrics_module):
    steps = [[2, 2], [0, 0], [1, 3], [0, 0], [0, 0], [3, 90]] + [[0, 0]] * 15  # 2 x 1, 1 x 3, 3 x 17..32 tokens
    stats = iter([{"running": 3, "waiting": 2, "kv_usage": {"swa": 0.5, "compressed": 0.75},
                   "prefix_cache_hit_tokens": 8, "prefix_cache_queries": 20, "iteration_tokens": steps}] * 100)
    m = metrics_module.Metrics({"model": "m", "version": "1"}, lambda: next(stats), 1024, poll_interval_s=0.05,
                               model_name="served")
    m.start()
    m.record(metrics_module.RequestRecord(num_prompt_tokens=7, num_output_tokens=4, finish_reason="stop",
                                          ttft_s=0.2, e2e_s=0.6, decode_s=0.3, itl_s=[0.1, 0.05, 0.15], max_tokens=16,
                                          **metrics_module.scheduling_times(10.0, 10.25, 10.5, 10.75)))
    m.record(metrics_module.RequestRecord(num_prompt_tokens=7, num_output_tokens=0, finish_reason="abort",
                                          ttft_s=None, e2e_s=0.1, decode_s=None))  # never scheduled
    time.sleep(0.3)
    m.stop()
    fam = FakeFamily.created
    assert fam["vllm:request_queue_time_seconds"].metrics[0].observed == [0.25]
    assert fam["vllm:request_prefill_time_seconds"].metrics[0].observed == [0.25]
    assert fam["vllm:request_inference_time_seconds"].metrics[0].observed == [0.5]
    assert fam["vllm:request_queue_time_seconds"].metrics[0].buckets[-1] == 7680.0
    iteration = fam["vllm:iteration_tokens_total"].metrics[0]  # polled many times, each step observed once
    assert sorted(iteration.observed) == [1, 1, 3, 30, 30, 30] and iteration.buckets[:3] == [1, 8, 16]
    assert VLLM_DASHBOARD <= set(fam)
    assert all(metric.labels["model_name"] == "served" for name, f in fam.items() if name.startswith("vllm:")
               for metric in f.metrics)
    assert fam["vllm:inter_token_latency_seconds"].metrics[0].observed == [0.1, 0.05, 0.15]  # one per gap
    assert fam["vllm:time_per_output_token_seconds"].metrics[0].observed == [0.1, 0.05, 0.15]
    assert fam["vllm:request_time_per_output_token_seconds"].metrics[0].observed == [pytest.approx(0.1)]
    assert fam["vllm:request_decode_time_seconds"].metrics[0].observed == [0.3]
    assert fam["vllm:time_to_first_token_seconds"].metrics[0].buckets[-1] == 2560.0  # vLLM v1's buckets
    assert fam["vllm:request_max_num_generation_tokens"].metrics[0].observed == [16]
    assert fam["vllm:kv_cache_usage_perc"].metrics[0].value == 0.75  # one series: the fullest pool
    assert fam["vllm:num_requests_waiting"].metrics[0].value == 2
    assert fam["vllm:prefix_cache_hits_total"].metrics[0].value == 8  # cumulative stats counted once
    assert fam["vllm:request_success_total"].metrics[0].labels["finished_reason"] == "stop"
    assert fam["vllm:prompt_tokens_total"].metrics[0].value == 14  # both requests


def test_a_response_that_merges_deltas_counts_one_inter_token_gap(metrics_module):
    """Gaps per delta that starts a response: per step while the senders keep up; the deltas merged
    into one response (the senders behind) make one gap, so the metric's IPC follows responses."""
    times = metrics_module.TokenTimes()
    for now, starts in ((1.0, True), (1.1, True), (1.2, False), (1.3, False), (1.45, True), (1.5, True)):
        times.arrived(now, starts)
    assert times.gaps == pytest.approx([0.1, 0.35, 0.05])  # 1.1 -> 1.45 spans the merged response
    assert (times.first, times.last) == (1.0, 1.5)


def test_usages_metrics_table_names_exactly_the_vllm_families(metrics_module):
    """docs/USAGE.md's table is what a dashboard author reads: every `vllm:` name it lists exists,
    and every `vllm:` family the model creates is listed."""
    import re
    from pathlib import Path

    FakeFamily.created = {}
    m = metrics_module.Metrics({"model": "m", "version": "1"}, lambda: {}, 1024, poll_interval_s=0.05,
                               model_name="served")
    m.start()
    m.stop()
    created = {name for name in FakeFamily.created if name.startswith("vllm:")}
    usage = (Path(__file__).parents[2] / "docs" / "USAGE.md").read_text()
    listed = set(re.findall(r"`(vllm:[a-z0-9_]+)", usage))
    assert created and listed == created, (sorted(listed - created), sorted(created - listed))
