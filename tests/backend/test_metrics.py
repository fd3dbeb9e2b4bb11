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
         "prefix_cache_replayed_tokens": 16, "prefix_cache_queries": 40},
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


def test_speculative_decoding_stats_reach_vllms_families(metrics_module):
    base = {"running": 1, "waiting": 0, "kv_usage": {}}
    stats = iter([
        {**base, "spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 5,
         "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0], "spec_decode_acceptance_rate": 5 / 12,
         "spec_decode_mean_acceptance_length": 1 + 5 / 4},
        {**base, "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 9,
         "spec_decode_num_accepted_tokens_per_pos": [6, 2, 1], "spec_decode_acceptance_rate": 0.3,
         "spec_decode_mean_acceptance_length": 1.9},
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
    assert fam["deepseek:spec_decode_draft_acceptance_rate"].metrics[0].value == 0.3
    assert fam["deepseek:spec_decode_mean_acceptance_length"].metrics[0].value == 1.9
