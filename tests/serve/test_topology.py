"""Where the models run: the ingress hosts the first model itself by default, or only routes when told not to.

Both topologies serve the same API on the fake model; what differs is which deployments exist, and so
which replicas a model's tokens cross.
"""

import httpx
import pytest
import ray
from ray import serve

from deployments.builder import build_app, deployment_name
from tests.serve.conftest import (BASE, FAKE_APP, FAKE_MODELS, FAKE_TWIN, FRAGILE_MODEL, fake_app_args,
                                  runs_user_code_in_a_thread_of_its_own)
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

ROUTER_APP = "fake-router"


def _deployments(app: str) -> set[str]:
    return set(serve.status().applications[app].deployments)


def test_by_default_the_ingress_hosts_the_first_model_and_the_others_have_deployments(fake_app, fake_client):
    first, second = FAKE_MODELS
    assert _deployments(FAKE_APP) == {"OpenAIIngress", deployment_name(second), deployment_name(FRAGILE_MODEL)}
    response = fake_client.post("/v1/completions", json={"model": first, "prompt": "local", "max_tokens": 5})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == echo("local", 5)
    assert serve.get_app_handle(FAKE_APP).model_stats.remote(first).result()["num_finished"] >= 1
    twin = fake_client.post("/v1/completions", json={"model": FAKE_TWIN, "prompt": "local", "max_tokens": 5}).json()
    assert twin["model"] == FAKE_TWIN and twin["choices"][0]["text"] == echo("local", 5)  # the same model, its own name


def test_every_replica_runs_our_code_on_serves_own_event_loop(fake_app):
    """No thread hop between the code that makes a chunk and the loop that writes it (deployments/builder.py)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{FAKE_APP}#")]
    assert {name.split("#")[1] for name in names} == _deployments(FAKE_APP)
    for name in names:
        replica = ray.get_actor(name, namespace="serve")
        assert ray.get(replica.__ray_call__.remote(runs_user_code_in_a_thread_of_its_own)) is False, name


def test_as_a_router_every_model_is_a_deployment_and_answers_the_same(fake_app):
    args = {**fake_app_args(), "ingress_hosts_first_model": False}
    args["models"] = args["models"][:2]
    serve.run(build_app(args), name=ROUTER_APP, route_prefix=f"/{ROUTER_APP}")
    try:
        assert _deployments(ROUTER_APP) == {"OpenAIIngress", *(deployment_name(m) for m in FAKE_MODELS)}
        with httpx.Client(base_url=f"{BASE}/{ROUTER_APP}", timeout=30) as client:
            for model in FAKE_MODELS:
                body = {"model": model, "prompt": "routed", "max_tokens": 6, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    text = "".join(response.iter_text())
                assert response.status_code == 200 and "[DONE]" in text
                plain = client.post("/v1/completions", json={**body, "stream": False}).json()
                assert plain["choices"][0]["text"] == echo("routed", 6)
    finally:
        serve.delete(ROUTER_APP, _blocking=False)  # its replicas leave while the next tests run
