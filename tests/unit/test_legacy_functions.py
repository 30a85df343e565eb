"""OpenAI's deprecated ``functions`` / ``function_call``, on the real serving layer over the fake model replaying
recorded answers: read as tool calling, answered as ``message.function_call`` (streamed: ``delta.function_call``), a
transcript's function messages rendered as the tool messages they became; parsed by the ``openai`` SDK's own types."""

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.token_requests import TokenizeRequest
from tests.serve.fake_model import REPLAY

FUNCTION = {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _body(answer: str, **extra) -> dict:
    content = f"Weather in Oslo? {REPLAY[0].decode()}{answer}{REPLAY[1].decode()}"  # the fake model answers this
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 200, "functions": [FUNCTION], **extra}


async def test_a_call_is_the_messages_function_call_streamed_or_not(tools_server):
    serving = tools_server.serving
    whole = ChatCompletion.model_validate(await serving.chat(parse_body(_body(CALL), ChatCompletionRequest)))
    message = whole.choices[0].message
    assert (message.function_call.name, message.function_call.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert message.tool_calls is None and whole.choices[0].finish_reason == "function_call"
    chunks = [ChatCompletionChunk.model_validate(c)
              async for c in serving.chat_stream(parse_body(_body(CALL, stream=True), ChatCompletionRequest))]
    fragments = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert fragments[0].name == "get_weather" and not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert "".join(f.arguments or "" for f in fragments) == '{"city": "Oslo"}'
    assert chunks[-1].choices[0].finish_reason == "function_call"


async def test_function_call_none_answers_in_text_and_a_named_one_is_forced(tools_server):
    serving = tools_server.serving
    plain = await serving.chat(parse_body(_body("It rains.", function_call="none"), ChatCompletionRequest))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "It rains."}
    assert plain["choices"][0]["finish_reason"] == "stop"
    named = parse_body(_body('{"city": "Oslo"}', function_call={"name": "get_weather"}), ChatCompletionRequest)
    assert named.tool_choice_resolved().name == "get_weather" and named.parallel_tool_calls is False
    forced = (await serving.chat(named))["choices"][0]
    assert forced["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


async def test_a_transcript_of_function_messages_renders_as_its_tool_calls(tools_server):
    prompts = tools_server.serving.prompts
    legacy = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
              {"role": "function", "name": "get_weather", "content": "sunny, 12 C"}]
    tools = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function":
                                                                    {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "sunny, 12 C"}]
    with_functions = parse_body({"messages": legacy, "functions": [FUNCTION]}, ChatCompletionRequest)
    with_tools = parse_body({"messages": tools, "tools": [{"type": "function", "function": FUNCTION}]}, ChatCompletionRequest)
    assert prompts.chat_text(with_functions) == prompts.chat_text(with_tools)
    tokenized = await tools_server.serving.tokenize(parse_body({"messages": legacy, "tools": with_tools.tools}, TokenizeRequest))
    assert tokenized["tokens"] == prompts.chat(with_tools)  # /tokenize reads the transcript as chat does
    assert with_functions.messages[2].tool_call_id == with_functions.messages[1].tool_calls[0]["id"]


@pytest.mark.parametrize("body, param", [
    ({"functions": [FUNCTION], "tools": [{"type": "function", "function": FUNCTION}]}, "functions"),
    ({"function_call": "auto"}, "functions"),
    ({"functions": []}, "functions"),
    ({"functions": ["get_weather"]}, "functions"),
    ({"functions": [FUNCTION], "function_call": "required"}, "function_call"),  # not among the legacy API's choices
    ({"functions": [FUNCTION], "function_call": 5}, "function_call"),
])
def test_functions_beside_tools_or_missing_are_a_400(body, param):
    with pytest.raises(APIError) as caught:
        parse_body({"messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, param)
