"""Our metrics as Ray gauges: the mapping from the gathered per-model dict, and the periodic export (no Ray needed)."""

import asyncio

import pytest

from app.metrics import render
from deployments.ray_metrics import RayMetricsExporter, ray_name, samples
from tests.unit.test_grafana_dashboard import populated_models


class FakeGauge:
    def __init__(self, name, description, tag_keys):
        self.name, self.description, self.tag_keys, self.values = name, description, tag_keys, {}

    def set(self, value, tags):
        assert set(tags) == set(self.tag_keys)  # Ray refuses a sample that lacks one of the gauge's tag keys
        self.values[tuple(sorted(tags.items()))] = value


class FakeGauges:
    def __init__(self):
        self.made = {}

    def __call__(self, name, description, tag_keys):
        assert name not in self.made  # one Ray metric per name, made once
        self.made[name] = FakeGauge(name, description, tag_keys)
        return self.made[name]

    def value(self, name, **tags):
        return self.made[name].values[tuple(sorted(tags.items()))]


async def until(condition, timeout_s=5.0):
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


async def stop(task):
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_every_rendered_sample_maps_to_a_ray_name_with_its_labels_as_tags():
    models = populated_models()
    exported = samples(models)
    lines = [line for line in render(models).splitlines() if line and not line.startswith("#")]
    assert len(exported) == len(lines)
    assert all(":" not in name and name.startswith("llm_serve_") for name, _, _ in exported)
    by_key = {(name, tuple(tags.items())): value for name, tags, value in exported}
    assert by_key[("llm_serve_num_requests_running", (("model_name", "m"),))] == 2.0
    assert by_key[("llm_serve_kv_cache_usage_perc", (("model_name", "m"),))] == 0.25
    assert by_key[("llm_serve_request_success_total", (("model_name", "m-twin"), ("finished_reason", "length")))] == 1.0
    assert by_key[("llm_serve_spec_decode_num_drafts_total", (("model_name", "m"),))] == 3.0
    assert by_key[("llm_serve_spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "m"), ("position", "0")))] == 2.0
    assert by_key[("llm_serve_time_to_first_token_seconds_bucket", (("model_name", "m"), ("le", "+Inf")))] == 3.0  # the failed request had no token
    assert by_key[("llm_serve_e2e_request_latency_seconds_count", (("model_name", "m"),))] == 4.0
    assert by_key[("llm_serve_iteration_tokens_total_bucket", (("model_name", "m"), ("le", "8.0")))] == 2.0
    assert ray_name("llm_serve:e2e_request_latency_seconds_sum") == "llm_serve_e2e_request_latency_seconds_sum"


def test_label_values_come_back_unescaped():
    exported = samples({'a"b\\c\nd': {"engine": {"num_running": 1}}})
    assert exported == [("llm_serve_num_requests_running", {"model_name": 'a"b\\c\nd'}, 1.0)]


def test_update_makes_each_gauge_once_and_sets_the_cumulative_values():
    gauges = FakeGauges()
    exporter = RayMetricsExporter(gauge_factory=gauges)
    models = populated_models()
    assert exporter.update(models) == len(samples(models))
    bucket = gauges.made["llm_serve_e2e_request_latency_seconds_bucket"]
    assert bucket.tag_keys == ("model_name", "le") and "llm_serve:e2e_request_latency_seconds_bucket" in bucket.description
    assert gauges.value("llm_serve_e2e_request_latency_seconds_bucket", model_name="m", le="0.5") == 4.0
    assert gauges.value("llm_serve_request_success_total", model_name="m", finished_reason="error") == 1.0

    models["m"]["engine"].update(num_running=0, num_preemptions=5)  # later counters: set again, never added
    exporter.update(models)
    exporter.update(models)
    assert gauges.value("llm_serve_num_requests_running", model_name="m") == 0.0
    assert gauges.value("llm_serve_num_preemptions_total", model_name="m") == 5.0


async def test_run_periodically_exports_each_round_and_survives_a_failed_gather(caplog):
    gauges = FakeGauges()
    exporter = RayMetricsExporter(gauge_factory=gauges)
    rounds = []

    async def gather():
        rounds.append(len(rounds))
        if len(rounds) in (2, 3):
            raise RuntimeError("replica busy")
        return {"m": {"engine": {"num_running": len(rounds)}}}

    task = asyncio.create_task(exporter.run_periodically(gather, interval_s=0.001))
    await until(lambda: len(rounds) >= 5)
    await stop(task)
    assert gauges.value("llm_serve_num_requests_running", model_name="m") >= 4.0
    assert sum("exporting metrics to Ray failed" in record.message for record in caplog.records) == 1  # not every round


async def test_a_plain_gather_works_too():
    gauges = FakeGauges()
    task = asyncio.create_task(RayMetricsExporter(gauge_factory=gauges).run_periodically(lambda: {"m": {"engine": {"kv_usage": 0.5}}}, 0.001))
    await until(lambda: "llm_serve_kv_cache_usage_perc" in gauges.made)
    await stop(task)
    assert gauges.value("llm_serve_kv_cache_usage_perc", model_name="m") == 0.5
