"""configs/grafana-dashboard.json asks only for metrics that app.metrics renders (and that Ray's export carries)."""

import json
import pathlib
import re

import pytest

from app.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, Histogram, RequestMetrics, RequestTiming, STEP_TOKEN_BUCKETS, render
from app.spec.stats import SpecDecodingStats

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json"
# The dashboard's ``prefix`` variable: GET /metrics names, or the same metrics through Ray's agent.
DIRECT, RAY = "llm_serve:", "ray_llm_serve_"
_NAME = re.compile(r"(?:llm_serve:|ray_llm_serve_)[a-zA-Z0-9_]+")
_QUANTILE = re.compile(r"histogram_quantile\(\s*[0-9.]+\s*,[^[]*?\b((?:llm_serve:|ray_llm_serve_)[a-zA-Z0-9_]+)")


def populated_models() -> dict[str, dict]:
    """What the ingress gathers for a busy speculative model and its twin: every metric we render has a sample."""
    requests = RequestMetrics()
    for reason, tokens in (("stop", 3), ("length", 4), ("abort", 1), ("error", 0)):
        timing = RequestTiming(arrival_s=0.0, prompt_tokens=5, sink=requests)
        for step in range(tokens):
            timing.tokens(0.1 + 0.02 * step, 1 if step else 2)
        timing.finish(0.5, reason)
        timing.phase_times = {"queue_s": 0.01, "prefill_s": 0.09, "decode_s": 0.4}
        requests.record(timing)
    requests.record_rejection("overloaded")
    speculation = SpecDecodingStats.new(3)
    speculation.observe_batch([3, 3, 2], [3, 1, 0])
    step_tokens = Histogram(STEP_TOKEN_BUCKETS)
    for tokens in (1, 7, 40, 300):
        step_tokens.observe(tokens)
    engine = {
        "num_running": 2, "num_waiting": 1, "kv_blocks_used": 10, "kv_blocks_total": 40, "kv_usage": 0.25,
        "prefix_cache_queried_tokens": 64, "prefix_cache_hit_tokens": 16, "num_preemptions": 1, "num_steps": 4,
        "num_generated_tokens": 8, "last_step_tokens": 300, "last_step_seqs": 2, "mean_tokens_per_step": 87.0,
        "mean_step_ms": 12.0, "step_tokens": step_tokens.to_dict(), "step_token_cap": 256, "num_steps_run_apart": 1,
        **{f"spec_{key}": value for key, value in speculation.to_dict().items()},  # as LLMEngine.stats() names them
    }
    return {"m": {"requests": requests.to_dict(), "engine": engine}, "m-twin": {"requests": requests.to_dict()}}


def test_the_busy_model_has_a_sample_of_every_engine_figure_we_export():
    engine = populated_models()["m"]["engine"]
    assert not (ENGINE_GAUGES.keys() | ENGINE_COUNTERS.keys()) - engine.keys()


def referenced_names(expression: str, prefix: str = DIRECT) -> set[str]:
    """The metric names a PromQL expression (or a variable's query) reads, with ``$prefix`` set to ``prefix``."""
    expanded = expression.replace("${prefix}", prefix).replace("$prefix", prefix)
    return set(_NAME.findall(expanded))


def quantile_names(expression: str, prefix: str = DIRECT) -> set[str]:
    """The metric each ``histogram_quantile(...)`` of the expression reads."""
    expanded = expression.replace("${prefix}", prefix).replace("$prefix", prefix)
    return set(_QUANTILE.findall(expanded))


def rendered(models: dict[str, dict]) -> tuple[set[str], dict[str, str]]:
    """The sample names of the Prometheus text (``_bucket``/``_sum``/``_count`` included) and each family's type."""
    text = render(models)
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    return names, kinds


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def expressions(board: dict) -> list[str]:
    """Every PromQL the dashboard sends: its panels' targets and its query variables."""
    exprs = [target["expr"] for panel in panels(board) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_the_extraction_finds_names_and_a_made_up_one_is_not_rendered():
    expr = 'sum(rate(${prefix}made_up_total{model_name=~"$model"}[5m])) / sum(rate(llm_serve:num_preemptions_total[5m]))'
    assert referenced_names(expr) == {"llm_serve:made_up_total", "llm_serve:num_preemptions_total"}
    assert referenced_names(expr, RAY) == {"ray_llm_serve_made_up_total", "llm_serve:num_preemptions_total"}
    names, _ = rendered(populated_models())
    assert referenced_names(expr) - names == {"llm_serve:made_up_total"}
    quantile = 'histogram_quantile(0.9, sum by (le) (rate(${prefix}time_to_first_token_seconds_bucket{a="b"}[1m])))'
    assert quantile_names(quantile) == {"llm_serve:time_to_first_token_seconds_bucket"}


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable():
    board = dashboard()
    assert board["schemaVersion"] >= 38 and board["title"] and board["uid"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {option["value"] for option in variables["prefix"]["options"]} == {DIRECT, RAY}
    assert "model_name" in variables["model"]["definition"] and variables["model"]["includeAll"]
    for panel in panels(board):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"], panel["title"]
            assert all(target["datasource"]["uid"] == "${DS_PROMETHEUS}" for target in panel["targets"])
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))


def test_every_metric_the_dashboard_reads_is_rendered_by_get_metrics():
    names, kinds = rendered(populated_models())
    referenced = set().union(*(referenced_names(expr) for expr in expressions(dashboard())))
    assert referenced and not referenced - names, sorted(referenced - names)
    for expr in expressions(dashboard()):
        for bucket in quantile_names(expr):  # quantiles read the _bucket series of a real histogram
            assert bucket.endswith("_bucket") and kinds[bucket.removesuffix("_bucket")] == "histogram", expr
    families = set(kinds)  # what the dashboard covers: every family we render
    read = {name.removesuffix(suffix) for name in referenced for suffix in ("_bucket", "_sum", "_count") if name.endswith(suffix)}
    assert not families - referenced - read, sorted(families - referenced - read)


def test_every_metric_the_dashboard_reads_is_exported_through_ray():
    from deployments.ray_metrics import samples

    exported = {"ray_" + name for name, _, _ in samples(populated_models())}
    referenced = set().union(*(referenced_names(expr, RAY) for expr in expressions(dashboard())))
    assert referenced and not referenced - exported, sorted(referenced - exported)


@pytest.mark.parametrize("title", ["TTFT", "Inter-token", "End-to-end"])
def test_latency_panels_show_p50_p90_p99(title):
    panel = next(panel for panel in panels(dashboard()) if panel["title"].startswith(title))
    quantiles = {re.search(r"histogram_quantile\(([0-9.]+)", target["expr"])[1] for target in panel["targets"]}
    assert quantiles == {"0.5", "0.9", "0.99"}
