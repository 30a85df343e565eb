"""A draft replica or a target replica killed mid-generation (``drafter: model`` across replicas).

An app of its own on the fake model (tests/serve/fake_model.py), each model in its own deployment: the target
(also served as ``target-spec``, asking the draft deployment for proposals through the real path: the front's
draft calls, Serve handles, the draft replica's ``propose``) and the draft. Killing the draft replica costs
time, never tokens: the streams finish with exactly the target's own text, and the replacement's drafts are
used again. Killing the target replica ends its streams with an explicit error event, quickly; none hangs.
(That verification keeps a real model's tokens, across replicas: tests/serve/test_speculative_http.py.)
"""

import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

from tests.serve.conftest import BASE
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

APP, PREFIX = "specfaults", "/specfaults"
TARGET, TWIN, DRAFT = "target", "target-spec", "draft"
PROMPT = "one, two, three, four, five, six, seven, eight, nine, ten, "
MAX_TOKENS = 80  # 80 fake steps of 20 ms at most, a draft round trip per 5 bytes: the kill lands mid-generation


def _args() -> dict:
    def served(name: str, **engine) -> dict:
        return {"model": {"source": name}, "engine": {"separate_process": False, **engine}, "replica": {"num_cpus": 0}}

    spec = {"drafter": "model", "draft": DRAFT, "num_speculative_tokens": 4, "served_name": TWIN}
    return {"server_factory": "tests.serve.fake_model:fake_model_server", "ingress_hosts_first_model": False,
            "models": [served(TARGET, speculative=spec), served(DRAFT)]}


@pytest.fixture(scope="module")
def spec_app(serve_cluster):
    from deployments.builder import build_app

    serve.run(build_app(_args()), name=APP, route_prefix=PREFIX)
    yield
    serve.delete(APP, _blocking=False)  # its replicas leave while the next tests run


def _body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def _kill_replica(deployment: str) -> None:
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)


async def _stream(model: str, kill: str | None, after_chunks: int = 4) -> tuple[str, list[dict], float]:
    """One streaming completion; kills ``kill``'s replica after a few chunks. Text, error events, seconds from
    the kill to the end of the stream."""
    text, errors, killed_at = "", [], None
    async with httpx.AsyncClient(base_url=BASE + PREFIX, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json={**_body(model), "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                text += event["choices"][0]["text"]
                chunks += 1
                if kill is not None and chunks == after_chunks:
                    _kill_replica(kill)
                    killed_at = time.monotonic()
    return text, errors, (time.monotonic() - killed_at) if killed_at else 0.0


def _complete(model: str) -> str:
    response = httpx.post(f"{BASE}{PREFIX}/v1/completions", json=_body(model), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _spec_stats() -> dict:
    return serve.get_app_handle(APP).model_stats.remote(TARGET).result()


def _wait_until_served(model: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        if httpx.post(f"{BASE}{PREFIX}/v1/completions", json=body, timeout=60).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"{model} was not served again within {timeout_s} s")


def test_killing_the_draft_replica_mid_generation_costs_no_token(spec_app):
    expected = echo(PROMPT, MAX_TOKENS)
    assert _complete(TARGET) == expected
    before = _spec_stats()
    assert _complete(TWIN) == expected  # speculation on, both replicas up
    after = _spec_stats()
    assert after["spec_num_drafts"] > before["spec_num_drafts"]
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]
    text, errors, _ = asyncio.run(_stream(TWIN, kill=f"LLMServer:{DRAFT}"))
    assert errors == [] and text == expected  # the target decoded on without drafts
    _wait_until_served(DRAFT)
    before = _spec_stats()
    assert _complete(TWIN) == expected  # and drafts from the replacement are used as before
    assert _spec_stats()["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]


def test_killing_the_target_replica_mid_generation_ends_its_stream_with_an_error_event(spec_app):
    text, errors, seconds = asyncio.run(_stream(TWIN, kill=f"LLMServer:{TARGET}"))
    assert len(errors) == 1 and errors[0]["code"] == "replica_unavailable", errors
    assert seconds < 10, seconds  # an error event, not a hang (Serve then replaces the replica: tests/serve/test_fake_errors.py)
