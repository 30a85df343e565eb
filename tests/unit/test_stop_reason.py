"""vLLM's ``stop_reason`` on the real serving layer over the fake model (one byte a token): each finished choice names
the stop token id that ended it, null where EOS or the length did, streamed or not (the engine's reasons, stop strings
included: tests/unit/test_detokenizer.py)."""

import pytest

from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tests.serve.fake_model import REPLAY

ANSWER = "It is sunny. Bye."


def _prompt(answer: str = ANSWER) -> str:
    return f"{REPLAY[0].decode()}{answer}{REPLAY[1].decode()}"


@pytest.mark.parametrize(("extra", "finish", "reason"), [
    ({"stop_token_ids": [ord(".")]}, "stop", ord(".")),
    ({}, "stop", None),  # EOS after the answer
    ({"max_tokens": 4}, "length", None),
])
async def test_a_finished_choice_names_what_stopped_it_streamed_or_not(tools_server, extra, finish, reason):
    serving = tools_server.serving
    chat = {"messages": [{"role": "user", "content": _prompt()}], "max_tokens": 64, **extra}
    completion = {"prompt": _prompt(), "max_tokens": 64, **extra}
    whole = [await serving.chat(parse_body(chat, ChatCompletionRequest)),
             await serving.completion(parse_body(completion, CompletionRequest))]
    streamed = [[c async for c in serving.chat_stream(parse_body({**chat, "stream": True}, ChatCompletionRequest))],
                [c async for c in serving.completion_stream(parse_body({**completion, "stream": True}, CompletionRequest))]]
    for answer in whole:
        [choice] = answer["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason)
    for chunks in streamed:
        choices = [choice for chunk in chunks for choice in chunk["choices"]]
        assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (finish, reason)
        assert not any("stop_reason" in choice for choice in choices[:-1])


async def test_a_tool_call_stream_names_it_on_its_last_chunk_alone(tools_server):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    answer = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>!'
    body = {"messages": [{"role": "user", "content": _prompt(answer)}], "tools": [weather], "stream": True,
            "stop_token_ids": [ord("!")]}
    chunks = [c async for c in tools_server.serving.chat_stream(parse_body(body, ChatCompletionRequest))]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("tool_calls", ord("!"))
    assert not any("stop_reason" in choice for choice in choices[:-1])


async def test_an_echo_of_the_prompt_alone_names_no_stop(tools_server):
    """max_tokens 0 with echo: the one token computed is not the answer's, nor what stopped it."""
    prompt = _prompt()
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "stop_token_ids": [ord(ANSWER[0])]}  # its one token
    [choice] = (await tools_server.serving.completion(parse_body(body, CompletionRequest)))["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (prompt, "length", None)
