"""vLLM's ``stream_options.continuous_usage_stats`` on the real serving layer over the fake model: every chunk carries
its choice's usage so far (its prompt's tokens, its tokens yet), which grows chunk by chunk and ends at that choice's
share of the usage chunk; without it chunks carry none."""

import pytest

from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 6, "n": 2, "stream": True}
COMPLETION = {"prompt": ["abc", "defg"], "n": 2, "max_tokens": 5, "stream": True}
OPTIONS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.fixture
def serving(tools_server):
    return tools_server.serving


async def _chunks(stream) -> list[dict]:
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_every_chunk_carries_its_choices_usage_so_far(serving, kind):
    if kind == "chat":
        chunks = await _chunks(serving.chat_stream(parse_body({**CHAT, **OPTIONS}, ChatCompletionRequest)))
        prompts = [len(serving.prompts.chat(parse_body(CHAT, ChatCompletionRequest)))] * 2
    else:
        chunks = await _chunks(serving.completion_stream(parse_body({**COMPLETION, **OPTIONS}, CompletionRequest)))
        prompts = [len(p) for p in COMPLETION["prompt"] for _ in range(2)]  # one byte a token; choice i: prompt i // 2
    *answer, final = chunks
    assert final["choices"] == [] and all(len(chunk["choices"]) == 1 for chunk in answer)
    by_choice: dict[int, list[int]] = {}
    for chunk in answer:
        index, usage = chunk["choices"][0]["index"], chunk["usage"]
        assert usage["prompt_tokens"] == prompts[index] and usage["total_tokens"] == prompts[index] + usage["completion_tokens"]
        by_choice.setdefault(index, []).append(usage["completion_tokens"])
    assert sorted(by_choice) == list(range(len(prompts)))
    for counts in by_choice.values():
        assert counts == sorted(counts) and counts[-1] == (6 if kind == "chat" else 5)
        assert counts[0] == (0 if kind == "chat" else 1)  # a chat's role chunk comes before any token
    assert sum(counts[-1] for counts in by_choice.values()) == final["usage"]["completion_tokens"]


async def test_without_it_only_the_usage_chunk_has_usage(serving):
    body = {**CHAT, "stream_options": {"include_usage": True}}
    *answer, final = await _chunks(serving.chat_stream(parse_body(body, ChatCompletionRequest)))
    assert "usage" in final and not any("usage" in chunk for chunk in answer)
