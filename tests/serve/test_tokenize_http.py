"""vLLM's /tokenize and /detokenize through the real app and HTTP on the embedded model: a chat's count is the
prompt_tokens its completion reports, and the ids read back as the text."""

import pytest

from tests.serve.conftest import MODEL

pytestmark = pytest.mark.serve

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_chats_token_count_is_what_its_completion_reports_and_ids_read_back(client):
    counted = client.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    completion = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert counted["count"] == completion["usage"]["prompt_tokens"] == len(counted["tokens"])
    prompt = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True}).json()
    assert client.post("/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]}).json()["prompt"].endswith("Hello there")
    assert len(prompt["token_strs"]) == prompt["count"]
    refused = client.post("/tokenize", json={"model": MODEL})
    assert refused.status_code == 400 and "either prompt or messages" in refused.json()["error"]["message"]
