"""vLLM's ``cache_salt`` from the request to the engine: every choice's engine request carries it (the scheduler then
shares prefix-cache blocks only among requests of one salt: tests/unit/test_kv_cache.py, test_scheduler.py), and so do
a draft model's calls for it; an empty salt is a 400."""

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.engine.request import Request, SamplingParams
from app.spec.remote import ModelDrafter
from app.config import SpecConfig
from tests.unit.fakes import CountingCore


async def test_each_choices_engine_request_carries_the_salt(tools_server, monkeypatch):
    seen = []
    original = CountingCore.add_requests
    monkeypatch.setattr(CountingCore, "add_requests", lambda self, requests: (seen.extend(r.cache_salt for r in requests),
                                                                             original(self, requests))[1])
    serving = tools_server.serving
    await serving.completion(parse_body({"prompt": "abc", "max_tokens": 2, "n": 2, "cache_salt": "tenant-1"}, CompletionRequest))
    await serving.chat(parse_body({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, ChatCompletionRequest))
    assert seen == ["tenant-1", "tenant-1", None]
    for kind, body in ((CompletionRequest, {"prompt": "a"}), (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}]})):
        with pytest.raises(APIError) as caught:
            parse_body({**body, "cache_salt": ""}, kind)
        assert caught.value.param == "cache_salt"


def test_a_draft_models_calls_carry_the_requests_salt():
    drafter = ModelDrafter(0, SpecConfig(drafter="model", draft="d", num_speculative_tokens=4), max_model_len=1000)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0), cache_salt="tenant-1")
    drafter.propose(request, 4, 1, 0.02, 1.0)
    [call] = drafter.take_calls()
    assert call.cache_salt == "tenant-1"


async def test_a_clients_request_id_names_the_answer_and_the_engine_keeps_its_own(tools_server):
    serving = tools_server.serving
    body = {"prompt": ["abc", "de"], "max_tokens": 2, "n": 2, "request_id": "job-7"}
    twice = [await serving.completion(parse_body(body, CompletionRequest)) for _ in range(2)]
    assert [answer["id"] for answer in twice] == ["cmpl-job-7", "cmpl-job-7"]  # the same id sent twice: both answered
    chunks = [c async for c in serving.chat_stream(parse_body(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True, "request_id": "job-8"},
        ChatCompletionRequest))]
    assert {c["id"] for c in chunks} == {"chatcmpl-job-8"}
    with pytest.raises(APIError) as caught:
        parse_body({"prompt": "a", "priority": 1}, CompletionRequest)
    assert caught.value.param == "priority"
    assert parse_body({"prompt": "a", "priority": 0}, CompletionRequest).priority == 0
