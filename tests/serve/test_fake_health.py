"""Liveness and readiness on a real Serve cluster, with the fake model (tests/serve/fake_model.py).

Readiness (``GET /health/ready``) says 503 until every model has warmed up; a wedged engine (a step that
never returns) fails its replica's health check within ``engine.step_timeout_s``, its clients get an
error event at once, and Serve replaces the replica. Both on one app: the readiness test deploys it (and
watches), the wedge test then wedges its third model.
"""

import json
import threading
import time

import httpx
import pytest
from ray import serve

from tests.serve.conftest import BASE, FAKE_MODELS, FAKE_TWIN, FRAGILE_MODEL, with_deployment_options
from tests.serve.fake_model import echo, warmup_release

pytestmark = pytest.mark.serve

APP, PREFIX = "probes", "/probes"
FRONT, SLOW, WEDGED = "probes-front", "probes-slow-warmup", "probes-wedge"  # "slow-warmup": warms up until released
STEP_TIMEOUT_S, HEALTH_PERIOD_S = 2.0, 1.0


def _args(names: list[str], **engine) -> dict:
    def served(name: str) -> dict:
        return {"model": {"source": name}, "engine": {"separate_process": False, **engine}, "replica": {"num_cpus": 0}}

    return {"server_factory": "tests.serve.fake_model:fake_model_server", "models": [served(name) for name in names]}


def _app():
    from deployments.builder import build_app

    app = build_app(_args([FRONT, SLOW, WEDGED], step_timeout_s=STEP_TIMEOUT_S))
    return with_deployment_options(app, health_check_period_s=HEALTH_PERIOD_S, graceful_shutdown_timeout_s=5)


@pytest.fixture(scope="module")
def probes_app(serve_cluster):
    yield
    serve.delete(APP, _blocking=False)  # its replicas leave while the next tests run


def _json(response: httpx.Response):
    try:
        return response.json()
    except json.JSONDecodeError:
        return response.text  # Serve's proxy answers in plain text before the app's ingress runs


def _poll(http: httpx.Client, path: str, done, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    response = http.get(path)
    while not done(response) and time.monotonic() < deadline:
        time.sleep(0.3)
        response = http.get(path)
    return response


def test_readiness_is_200_when_every_model_is_warm(fake_client):
    ready = fake_client.get("/health/ready")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "models": [FAKE_MODELS[0], FAKE_TWIN, FAKE_MODELS[1], FRAGILE_MODEL]}
    assert fake_client.get("/health").status_code == 200  # liveness, as before


def test_readiness_is_503_until_every_model_has_warmed_up(probes_app):
    release = warmup_release(SLOW)  # the slow model warms up until this file exists: once a probe has seen it warming
    release.unlink(missing_ok=True)
    deploying = threading.Thread(target=serve.run, args=(_app(),), kwargs={"name": APP, "route_prefix": PREFIX})
    deploying.start()
    seen = []
    try:
        with httpx.Client(base_url=BASE + PREFIX, timeout=60) as http:  # the proxy holds a request until the ingress runs
            while deploying.is_alive():
                response = http.get("/health/ready")
                seen.append((response.status_code, _json(response)))
                if response.status_code == 503:
                    release.touch()
                time.sleep(0.3)
            deploying.join()
            ready = _poll(http, "/health/ready", lambda r: r.status_code == 200, timeout_s=10)
            assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
            served = http.post("/v1/completions", json={"model": SLOW, "prompt": "warm", "max_tokens": 4})
            assert served.status_code == 200 and served.json()["choices"][0]["text"] == echo("warm", 4)
        print("readiness while deploying:", seen)
        # while the slow model warmed up, the ingress answered readiness probes: 503, naming that model only;
        # 200 only once it had warmed up, and from then on
        statuses = [status for status, _ in seen]
        waiting = [body for status, body in seen if status == 503]
        assert waiting and all(body["status"] == "not_ready" and list(body["waiting"]) == [SLOW] for body in waiting), seen
        first_ready = statuses.index(200) if 200 in statuses else len(statuses)
        assert 503 not in statuses[first_ready:] and set(statuses[:first_ready]) <= {404, 503}, seen
    finally:
        release.touch()  # a failed probe must not leave the deploy waiting
        deploying.join()
        release.unlink(missing_ok=True)


def test_a_wedged_engine_fails_its_health_check_and_serve_replaces_the_replica(probes_app):
    wedged, step_timeout_s, period_s = WEDGED, STEP_TIMEOUT_S, HEALTH_PERIOD_S
    if APP not in serve.status().applications:  # run without the readiness test, which deploys it
        warmup_release(SLOW).touch()  # no one watches the slow model warm up here
        serve.run(_app(), name=APP, route_prefix=PREFIX)
        warmup_release(SLOW).unlink()
    with httpx.Client(base_url=BASE + PREFIX, timeout=30) as http:
        started = time.monotonic()
        body = {"model": wedged, "prompt": "wedge-engine", "max_tokens": 50, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        error_after_s = time.monotonic() - started
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "replica_unavailable", events
        # the bound, one health-check period to notice, and some slack for a loaded 2-core machine
        assert error_after_s < step_timeout_s + 2 * period_s + 5, error_after_s
        liveness = http.get("/health")  # until its replica is replaced, the app is not live as a whole
        assert liveness.status_code == 503 and wedged in liveness.json()["failing"], liveness.text
        while time.monotonic() - started < 60:  # Serve marks the replica unhealthy and starts another one
            answer = http.post("/v1/completions", json={"model": wedged, "prompt": "back", "max_tokens": 3})
            if answer.status_code == 200:
                break
            assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
            time.sleep(0.5)
        replaced_after_s = time.monotonic() - started
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == echo("back", 3)
        assert replaced_after_s < 60, replaced_after_s
        print(f"wedged engine: error event after {error_after_s:.1f} s, replacement serving after {replaced_after_s:.1f} s")
