import pytest

from app.api.errors import APIError, to_api_error
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.engine import EngineOverloadedError


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{bad", 400, None),
        (b"[]", 400, None),
        ({"model": "m"}, 400, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ({"model": "m", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "m", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": "m", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ],
)
def test_bad_completion_bodies(body, status, param):
    with pytest.raises(APIError) as info:
        parse_body(body, CompletionRequest)
    assert info.value.status == status
    assert info.value.param == param
    assert info.value.to_dict()["error"]["message"]


def test_chat_needs_messages():
    with pytest.raises(APIError, match="messages"):
        parse_body({"model": "m", "messages": []}, ChatCompletionRequest)


def test_defaults_fill_unset_fields_only():
    request = parse_body({"prompt": "x", "top_p": 0.5}, CompletionRequest)
    params = request.sampling_params(8, {"temperature": 0.2, "top_p": 0.9})
    assert params.temperature == 0.2 and params.top_p == 0.5


def test_error_mapping_unwraps_causes():
    class Wrapped(Exception):
        def __init__(self, cause):
            self.cause = cause

    assert to_api_error(Wrapped(APIError(404, "gone"))).status == 404
    assert to_api_error(EngineOverloadedError("full")).status == 503
    assert to_api_error(ValueError("bad")).status == 500  # an unexpected ValueError is ours (tests/unit/test_errors.py)


def test_sampling_combinations_the_fields_cannot_check_are_400s():
    request = parse_body({"prompt": "x", "min_tokens": 10, "max_tokens": 5}, CompletionRequest)
    with pytest.raises(APIError, match="min_tokens") as info:
        request.sampling_params(request.max_tokens)
    assert info.value.status == 400


def test_logprobs_requests_map_to_sampling():
    completion = parse_body({"prompt": "x", "logprobs": 3}, CompletionRequest)
    assert completion.sampling_params(4).logprobs == 3
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_body({**chat, "logprobs": True, "top_logprobs": 2}, ChatCompletionRequest).sampling_params(4).logprobs == 2
    assert parse_body({**chat, "logprobs": True}, ChatCompletionRequest).sampling_params(4).logprobs == 0
    assert parse_body(chat, ChatCompletionRequest).sampling_params(4).logprobs is None
    with pytest.raises(APIError, match="top_logprobs requires logprobs"):
        parse_body({**chat, "top_logprobs": 2}, ChatCompletionRequest)
