"""GET /metrics on the fake model: Prometheus text whose counters move with the requests actually served."""

import re

import pytest

from tests.serve.conftest import FAKE_MODELS, FAKE_TWIN
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve


def _metrics(fake_client) -> dict[str, float]:
    response = fake_client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _get(samples: dict[str, float], name: str, model: str, extra: str = "") -> float:
    return samples.get(f'llm_serve:{name}{{model_name="{model}"{extra}}}', 0.0)


def test_counters_and_histograms_follow_the_requests_served(fake_client):
    model = FAKE_MODELS[1]
    before = _metrics(fake_client)
    for tokens in (3, 5):
        body = {"model": model, "prompt": "count me", "max_tokens": tokens, "stream": True}
        with fake_client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200 and "[DONE]" in "".join(response.iter_text())
    twin = fake_client.post("/v1/completions", json={"model": FAKE_TWIN, "prompt": "twin", "max_tokens": 4})
    assert twin.json()["choices"][0]["text"] == echo("twin", 4)
    after = _metrics(fake_client)

    def moved(name: str, served: str = model, extra: str = "") -> float:
        return _get(after, name, served, extra) - _get(before, name, served, extra)

    assert moved("request_success_total", extra=',finished_reason="length"') == 2
    assert moved("generation_tokens_total") == 8 and moved("prompt_tokens_total") == 2 * len("count me")
    assert moved("time_to_first_token_seconds_count") == 2 and moved("e2e_request_latency_seconds_count") == 2
    assert moved("inter_token_latency_seconds_count") == 8 - 2  # a gap per engine step after each request's first
    assert moved("request_time_per_output_token_seconds_count") == 2  # one per request of more than one token
    assert moved('time_to_first_token_seconds_bucket', extra=',le="+Inf"') == 2
    assert moved("request_success_total", FAKE_TWIN, ',finished_reason="length"') == 1  # the twin counts apart
    for served in FAKE_MODELS:  # the engine's gauges, for the model the ingress hosts and for the others
        assert re.search(rf'llm_serve:num_requests_running\{{model_name="{served}"\}}', "\n".join(after))
