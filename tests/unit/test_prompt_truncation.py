"""vLLM's ``truncate_prompt_tokens`` on the real serving layer over the fake model (one token per byte; it answers
with the prompt it read): a longer prompt keeps its last tokens (``truncation_side: right``: its first), the usage
counts what the model read, echo shows it, and a size past the context is a 400."""

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 4, "return_token_ids": True}


@pytest.fixture
def serving(tools_server):
    return tools_server.serving


async def _complete(serving, **fields) -> dict:
    return await serving.completion(parse_body({"prompt": "abcdef", "max_tokens": 3, **fields}, CompletionRequest))


async def test_a_longer_prompt_keeps_its_last_tokens_or_its_first(serving):
    left = await _complete(serving, truncate_prompt_tokens=3)
    assert left["choices"][0]["text"] == "def" and left["usage"]["prompt_tokens"] == 3  # the fake model echoes what it read
    right = await _complete(serving, truncate_prompt_tokens=3, truncation_side="right")
    assert right["choices"][0]["text"] == "abc" and right["usage"]["prompt_tokens"] == 3
    for keep in (6, 100, -1):  # no longer than that: as it was
        assert (await _complete(serving, truncate_prompt_tokens=keep))["usage"]["prompt_tokens"] == 6
    echoed = await _complete(serving, truncate_prompt_tokens=2, echo=True)
    assert echoed["choices"][0]["text"] == "ef" + "efe"  # the prompt the model read, then its answer


async def test_a_chat_prompt_keeps_its_last_tokens(serving):
    whole = await serving.chat(parse_body(CHAT, ChatCompletionRequest))
    cut = await serving.chat(parse_body({**CHAT, "truncate_prompt_tokens": 5}, ChatCompletionRequest))
    assert cut["prompt_token_ids"] == whole["prompt_token_ids"][-5:] and cut["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("keep, match", [(0, "would leave no prompt"), (10**7, "past the model's context")])
async def test_nothing_left_or_a_size_past_the_context_is_a_400(serving, keep, match):
    with pytest.raises(APIError, match=match) as caught:
        await _complete(serving, truncate_prompt_tokens=keep)
    assert caught.value.status == 400


def test_a_side_that_is_neither_is_a_400():
    with pytest.raises(APIError) as caught:
        parse_body({"prompt": "a", "truncate_prompt_tokens": 1, "truncation_side": "middle"}, CompletionRequest)
    assert caught.value.param == "truncation_side"


async def test_max_tokens_past_the_room_the_prompt_leaves_is_capped_by_it_as_vllm_does(serving):
    """A budget a prompt leaves no room for ends the answer at the context's end (finish_reason "length"), as vLLM
    caps it; a max_tokens longer than the whole context is a 400."""
    from tests.serve.fake_model import MAX_MODEL_LEN

    prompt = "ab" * ((MAX_MODEL_LEN - 6) // 2)  # 6 tokens of room (one byte a token)
    answer = await serving.completion(parse_body({"prompt": prompt, "max_tokens": 50}, CompletionRequest))
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length"
    with pytest.raises(APIError) as caught:
        await _complete(serving, max_tokens=MAX_MODEL_LEN + 1)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "context_length_exceeded", "max_tokens")
    with pytest.raises(APIError) as caught:  # a min_tokens the room cannot hold: the context's 400, naming it
        await serving.completion(parse_body({"prompt": prompt, "max_tokens": 50, "min_tokens": 7}, CompletionRequest))
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "min_tokens")
