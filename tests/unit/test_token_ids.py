"""vLLM's ``return_token_ids`` on the real serving layer over the fake model (one token per byte): each answer's token
ids are its text's, the prompt's are what generation read, and a stream carries the same ids as the whole answer."""

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

COMPLETION = {"prompt": ["abc", "defg"], "n": 2, "max_tokens": 5, "return_token_ids": True}
CHAT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 6, "n": 2, "return_token_ids": True}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def serving(tools_server):
    return tools_server.serving


async def test_completions_give_each_choice_its_prompts_and_answers_ids_streamed_or_not(serving):
    whole = await serving.completion(parse_body(COMPLETION, CompletionRequest))
    for choice in whole["choices"]:
        prompt = COMPLETION["prompt"][choice["index"] // 2]
        assert choice["prompt_token_ids"] == serving.tokenizer.encode(prompt)
        assert choice["token_ids"] == list(choice["text"].encode()) and len(choice["token_ids"]) == 5
    streamed: dict[int, dict] = {}
    async for chunk in serving.completion_stream(parse_body({**COMPLETION, "stream": True}, CompletionRequest)):
        for choice in chunk["choices"]:
            seen = streamed.setdefault(choice["index"], {"token_ids": [], "prompts": []})
            seen["token_ids"] += choice["token_ids"]
            seen["prompts"].append(choice.get("prompt_token_ids"))
    for choice in whole["choices"]:
        seen = streamed[choice["index"]]
        assert seen["token_ids"] == choice["token_ids"]
        assert seen["prompts"][0] == choice["prompt_token_ids"] and not any(seen["prompts"][1:])  # the first chunk's


async def test_chat_gives_the_prompts_ids_once_and_each_choices_answer_streamed_or_not(serving):
    request = parse_body(CHAT, ChatCompletionRequest)
    whole = await serving.chat(request)
    assert whole["prompt_token_ids"] == serving.prompts.chat(request)
    for choice in whole["choices"]:
        assert choice["token_ids"] == list(choice["message"]["content"].encode()) and len(choice["token_ids"]) == 6
    chunks = [c async for c in serving.chat_stream(parse_body({**CHAT, "stream": True}, ChatCompletionRequest))]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"] and not any("prompt_token_ids" in c for c in chunks[1:])
    for choice in whole["choices"]:
        ids = [i for c in chunks for ch in c["choices"] if ch["index"] == choice["index"] for i in ch.get("token_ids", [])]
        assert ids == choice["token_ids"]


async def test_without_it_no_ids_and_streamed_beside_tools_it_is_a_400(serving):
    answer = await serving.chat(parse_body({**CHAT, "return_token_ids": False}, ChatCompletionRequest))
    assert "prompt_token_ids" not in answer and not any("token_ids" in c for c in answer["choices"])
    with pytest.raises(APIError) as caught:
        parse_body({**CHAT, "stream": True, "tools": [WEATHER]}, ChatCompletionRequest)
    assert caught.value.param == "return_token_ids"
    answer = await serving.chat(parse_body({**CHAT, "tools": [WEATHER]}, ChatCompletionRequest))  # not streamed: given
    assert all(len(c["token_ids"]) == 6 for c in answer["choices"])


async def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id_streamed_or_not(serving):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>`` (a chat entry keeps its text's
    bytes); a completion's offsets count those names, as vLLM's do, and a stream's chunks continue them."""
    body = {"prompt": "abc", "max_tokens": 4, "logprobs": 0, "return_tokens_as_token_ids": True}
    whole = (await serving.completion(parse_body(body, CompletionRequest)))["choices"][0]
    assert whole["logprobs"]["tokens"] == [f"token_id:{b}" for b in whole["text"].encode()]
    assert whole["logprobs"]["text_offset"] == [0, 11, 22, 33]  # len("token_id:97") == 11
    chunks = [c async for c in serving.completion_stream(parse_body({**body, "stream": True}, CompletionRequest))]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((lp["tokens"] for lp in streamed), []) == whole["logprobs"]["tokens"]
    assert sum((lp["text_offset"] for lp in streamed), []) == whole["logprobs"]["text_offset"]
    chat = {**CHAT, "n": 1, "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": False}
    answer = (await serving.chat(parse_body(chat, ChatCompletionRequest)))["choices"][0]
    entries = answer["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{b}" for b in answer["message"]["content"].encode()]
    assert [e["bytes"] for e in entries] == [[b] for b in answer["message"]["content"].encode()]
    plain = (await serving.chat(parse_body({**chat, "return_tokens_as_token_ids": False}, ChatCompletionRequest)))["choices"][0]
    assert [e["token"] for e in plain["logprobs"]["content"]] == list(plain["message"]["content"])
