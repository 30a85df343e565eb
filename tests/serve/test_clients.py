"""Callers as users have them: the openai Python client, and a separate Ray job using the app handle."""

import json
import subprocess
import sys
import textwrap

import openai
import pytest

from tests.conftest import ROOT
from tests.serve.conftest import BASE, MODEL

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def oai(serve_app):
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")


def test_openai_client_chat_non_streamed(oai):
    response = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    assert "Paris" in response.choices[0].message.content
    assert response.usage.completion_tokens > 0


def test_openai_client_chat_streamed(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, stream=True
    )
    parts = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(parts) > 2 and "Paris" in "".join(parts)


def test_openai_client_sees_errors(oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens"):  # the embedded model has none
        oai.completions.create(model=MODEL, prompt="def f():", suffix="    return 1", max_tokens=4)


DRIVER = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray import serve

    ray.init(address=sys.argv[1], log_to_driver=False)
    handle = serve.get_app_handle("default")
    body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    whole = handle.completions.remote(body).result()
    pieces = [c["choices"][0]["text"] for c in handle.options(stream=True).completions_stream.remote(body) if c["choices"]]
    print(json.dumps({"whole": whole["choices"][0]["text"], "streamed": "".join(pieces)}))
    """
)


def test_handle_from_a_separate_ray_job(serve_app, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    result = subprocess.run(
        [sys.executable, str(script), serve_app["gcs_address"]], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["whole"] and answer["whole"] == answer["streamed"]


def test_openai_client_gets_logprobs(oai):
    response = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=5,
        logprobs=True, top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(item.logprob <= 0 and len(item.top_logprobs) == 2 for item in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
