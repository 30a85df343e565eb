"""A draft replica or a target replica killed mid-generation (``drafter: model`` across replicas).

An app of its own, each model in its own deployment: the GPTQ target (also served as ``target-spec``, verifying
what the draft deployment proposes) and the embedded model as the draft. Killing the draft replica costs time,
never tokens: the streams finish with exactly the target's own text. Killing the target replica ends its
streams with an explicit error event, quickly; none hangs.
"""

import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

from tests.serve.conftest import BASE, TEST_STEP_TOKENS

pytestmark = pytest.mark.serve

APP, PREFIX = "specfaults", "/specfaults"
TARGET, TWIN, DRAFT = "target", "target-spec", "draft"
PROMPT = "Write the numbers from one to forty in words, separated by commas:"
MAX_TOKENS = 48


def _args() -> dict:
    model = {"dtype": "float32", "device": "cpu", "max_model_len": 1024}
    replica = {"num_cpus": 0}
    return {
        "ingress_hosts_first_model": False,
        "models": [
            {"model": {**model, "source": "smollm2-135m-instruct-gptq", "name": TARGET, "quantization": "gptq"},
             "engine": {"kv_cache_memory_mb": 256, "max_num_batched_tokens": TEST_STEP_TOKENS, "speculative": {
                 "drafter": "model", "draft": DRAFT, "num_speculative_tokens": 4, "served_name": TWIN,
                 "adaptive": False}},  # drafts at every step, paying or not: the kill must cut calls in flight
             "replica": replica},
            {"model": {**model, "source": "smollm2-135m-instruct", "name": DRAFT},
             "engine": {"kv_cache_memory_mb": 256, "max_num_batched_tokens": TEST_STEP_TOKENS}, "replica": replica},
        ],
    }


@pytest.fixture(scope="module")
def spec_app(serve_cluster):
    from deployments.builder import build_app

    serve.run(build_app(_args()), name=APP, route_prefix=PREFIX)
    yield
    serve.delete(APP)


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


def _drafts() -> int:
    stats = serve.get_app_handle(APP).model_stats.remote(TARGET).result()
    return stats["spec_by_name"][TWIN]["num_drafts"]


def _wait_until_served(model: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        if httpx.post(f"{BASE}{PREFIX}/v1/completions", json=body, timeout=60).status_code == 200:
            return
        time.sleep(1)
    raise AssertionError(f"{model} was not served again within {timeout_s} s")


def test_killing_the_draft_replica_mid_generation_costs_no_token(spec_app):
    expected = _complete(TARGET)
    before = _drafts()
    assert _complete(TWIN) == expected  # speculation on, both replicas up
    assert _drafts() > before
    text, errors, _ = asyncio.run(_stream(TWIN, kill=f"LLMServer:{DRAFT}"))
    assert errors == [] and text == expected  # the target decoded on without drafts
    _wait_until_served(DRAFT)
    assert _complete(TWIN) == expected  # and drafts from the replacement are verified as before


def test_killing_the_target_replica_mid_generation_ends_its_stream_with_an_error_event(spec_app):
    text, errors, seconds = asyncio.run(_stream(TWIN, kill=f"LLMServer:{TARGET}"))
    assert len(errors) == 1 and errors[0]["code"] == "replica_unavailable", errors
    assert seconds < 10, seconds  # an error event, not a hang (Serve then replaces the replica: tests/serve/test_fake_errors.py)
