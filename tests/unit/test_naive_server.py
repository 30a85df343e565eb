"""The naive baseline server (benchmarks/naive_server.py) with a stub model and tokenizer: no weights, no Ray."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("naive_server", ROOT / "benchmarks" / "naive_server.py")
naive_server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(naive_server)

EOS = 0


class StubTokenizer:
    """Token i is the word "w<i>"; 0 is EOS."""

    eos_token_id = EOS
    pad_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(f" w{i}" for i in ids if not (skip_special_tokens and i == EOS))


class StubModel:
    """Greedy "generation": counts up from the last prompt token, and says EOS after ``eos_after`` tokens
    unless ``min_new_tokens`` holds it back; streams through ``streamer`` as transformers' generate does."""

    def __init__(self, eos_after: int = 3) -> None:
        self.eos_after = eos_after
        self.calls: list[dict] = []

    def generate(self, input_ids, streamer=None, max_new_tokens=16, min_new_tokens=0, stopping_criteria=(), **kwargs):
        self.calls.append({"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, **kwargs})
        assert kwargs["do_sample"] is False
        if streamer is not None:
            streamer.put(input_ids)
        out, last = input_ids, int(input_ids[0, -1])
        for step in range(max_new_tokens):
            token = EOS if step >= self.eos_after and step >= min_new_tokens else last + step + 1
            out = torch.cat([out, torch.tensor([[token]])], dim=1)
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if token == EOS or any(bool(c(out, None).all()) for c in stopping_criteria):
                break
        if streamer is not None:
            streamer.end()
        return out


@pytest.fixture
def model():
    return StubModel()


@pytest.fixture
def client(model):
    return TestClient(naive_server.create_app(model, StubTokenizer(), "stub"))


def test_completion_stops_at_eos_unless_told_otherwise(client, model):
    r = client.post("/v1/completions", json={"model": "stub", "prompt": "ab abc", "max_tokens": 8})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == " w4 w5 w6"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}  # EOS counted, not shown

    body = client.post("/v1/completions", json={"prompt": "ab abc", "max_tokens": 8, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    assert model.calls[-1]["min_new_tokens"] == 8

    body = client.post("/v1/completions", json={"prompt": "ab abc", "max_tokens": 8, "min_tokens": 5}).json()
    assert body["usage"]["completion_tokens"] == 6


def test_stream_sends_text_then_finish_then_usage(client):
    body = {"model": "stub", "prompt": "ab abc", "max_tokens": 6, "min_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.split() == ["w4", "w5", "w6", "w7", "w8", "w9"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_through_the_template_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "ignore_eos": True}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " w12 w13"}  # after "<assistant>" (11 characters)
    assert body["usage"]["prompt_tokens"] == 6
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).split() == ["w12", "w13", "w14"]
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400


def test_bad_requests(client):
    assert client.post("/v1/completions", json={"prompt": "", "max_tokens": 4}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "min_tokens": 3}).status_code == 400
    assert client.post("/v1/completions", json={"model": "other", "prompt": "a"}).status_code == 404
    assert client.get("/v1/models").json()["data"][0]["id"] == "stub"
    assert client.get("/health").status_code == 200


def test_does_not_import_ray():
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('n', sys.argv[1]); "
            "s.loader.exec_module(importlib.util.module_from_spec(s)); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks" / "naive_server.py")], check=True)
