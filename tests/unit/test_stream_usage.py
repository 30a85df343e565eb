"""vLLM's ``stream_options.continuous_usage_stats`` on the real serving layer over the fake model: every chunk carries
the usage so far, which grows by each chunk's tokens and ends at the usage chunk's figures; without it chunks carry
none."""

import pytest

from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 6, "stream": True}
COMPLETION = {"prompt": ["abc", "defg"], "n": 2, "max_tokens": 5, "stream": True}


@pytest.fixture
def serving(tools_server):
    return tools_server.serving


async def _chunks(stream) -> list[dict]:
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_every_chunk_carries_the_usage_so_far_and_the_last_is_the_usage_chunks(serving, kind):
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if kind == "chat":
        chunks = await _chunks(serving.chat_stream(parse_body({**CHAT, **options}, ChatCompletionRequest)))
    else:
        chunks = await _chunks(serving.completion_stream(parse_body({**COMPLETION, **options}, CompletionRequest)))
    *answer, final = chunks
    assert final["choices"] == [] and all(chunk["choices"] for chunk in answer)
    prompt = final["usage"]["prompt_tokens"]
    generated = [chunk["usage"]["completion_tokens"] for chunk in answer]
    assert all(chunk["usage"]["prompt_tokens"] == prompt and chunk["usage"]["total_tokens"] == prompt + done
               for chunk, done in zip(answer, generated))
    assert generated == sorted(generated) and generated[-1] == final["usage"]["completion_tokens"]
    assert generated[-1] == (6 if kind == "chat" else 2 * 2 * 5)


async def test_without_it_only_the_usage_chunk_has_usage(serving):
    body = {**CHAT, "stream_options": {"include_usage": True}}
    *answer, final = await _chunks(serving.chat_stream(parse_body(body, ChatCompletionRequest)))
    assert "usage" in final and not any("usage" in chunk for chunk in answer)
