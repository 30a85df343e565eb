"""The Responses API over the chat path: requests translated (or refused, naming what), answers and streams in
the Responses shape on the real serving layer over the fake model; a stream's events assemble to the response."""

from __future__ import annotations

import json

import pytest

from app.api import response_stream, responses
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body
from tests.serve.fake_model import REPLAY

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_input_items_become_the_chat_messages_with_instructions_first():
    body = {"model": "m", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 20,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Oslo?"}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                      {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]}
    chat = responses.chat_body(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert chat["messages"][1]["content"] == "Weather\nin Oslo?"  # text parts as lines, as the chat endpoint's
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one message
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert chat["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}} and chat["max_tokens"] == 20
    parse_body(chat, ChatCompletionRequest)  # a chat request the chat endpoint takes as it is
    formatted = responses.chat_body({"model": "m", "input": "Hi", "text": {"format": {"type": "json_schema", "name": "w",
                                                                                   "schema": {"type": "object"}}}})
    assert formatted["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    parse_body(formatted, ChatCompletionRequest)


@pytest.mark.parametrize("extra, named", [
    ({"previous_response_id": "resp_1"}, "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text parts only"),
    ({"reasoning": {"effort": "high", "summary": "verbose"}}, "reasoning.summary"),
    ({"reasoning": {"mode": "deep"}}, "reasoning.mode"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "not both"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"background": True}, "background"),
    ({"modalities": ["text"]}, "modalities"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"include": ["file_search_call.results"]}, "file_search_call.results"),
    ({"top_logprobs": 2}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),  # the chat request's check, named as asked
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "as a string"),
    ({"input": None}, "input is required"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"tools": [{**WEATHER, "paramters": {}}]}, "tools[0].paramters"),  # a misspelt field: no tool of no arguments
    ({"text": {"verbosity": "low"}}, "text.verbosity is not supported"),  # as chat's verbosity
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"tool_choice": {"type": "web_search_preview"}}, '{"type": "function", "name": ...}'),  # the Responses shape
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "get_weather"}}, '"tools": [{"type": "function", "name"'),
])
def test_what_the_chat_path_cannot_do_is_a_400_naming_it(extra, named):
    with pytest.raises(APIError) as refused:
        responses.parse_request(json.dumps({"model": "m", "input": "Hi", **extra}).encode())
    assert refused.value.status == 400 and named in refused.value.message


def test_our_own_output_sent_back_as_input_is_one_assistant_turn_and_common_fields_are_taken():
    """An answer's message and call items, replayed as input (the Agents SDK does), are the one assistant turn they
    were; a reasoning item is dropped; an all-null reasoning, the no-op include and sampling extras are taken."""
    body = {"model": "m", "reasoning": {"effort": None, "summary": None}, "include": ["reasoning.encrypted_content"],
            "seed": 7, "stop": ["\n\n"], "prompt_cache_retention": "24h",
            "input": [{"role": "user", "content": "Weather in Oslo?"}, {"type": "reasoning", "summary": []},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    _, chat = responses.parse_request(json.dumps(body).encode())
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Weather in Oslo?"), ("assistant", "Let me check."), ("tool", "sunny")]
    assert [c["id"] for c in chat.messages[1].tool_calls] == ["c1"] and chat.seed == 7 and chat.stop == ["\n\n"]
    _, logged = responses.parse_request(json.dumps({"model": "m", "input": "Hi", "include": ["message.output_text.logprobs"],
                                                    "top_logprobs": 2}).encode())
    assert (logged.logprobs, logged.top_logprobs) == (True, 2)


def test_a_replayed_reasoning_item_is_its_turns_thinking_and_text_after_calls_stays_in_their_turn():
    """An agent loop replays its output: the thinking reaches the template with its turn (as vLLM reads a reasoning
    item: its text, else its summary's), and [message, call, message] stays one assistant turn before the result."""
    body = {"model": "m", "input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need weather."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done soon."}]},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sunny: say so."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]}]}
    _, chat = responses.parse_request(json.dumps(body).encode())
    assert [(m.role, m.content, m.reasoning) for m in chat.messages] == [
        ("user", "Weather in Oslo?", None), ("assistant", "Checking.\n\nDone soon.", "Need weather."),
        ("tool", "sunny", None), ("assistant", "It is sunny.", "Sunny: say so.")]
    assert [c["id"] for c in chat.messages[1].tool_calls] == ["c1"]


def _replayed(answer: str, **extra) -> dict:
    """A response request the fake model answers with ``answer``."""
    return {"model": "fake-tools", "input": f"Weather? {REPLAY[0].decode()}{answer}{REPLAY[1].decode()}", "tools": [WEATHER],
            "max_output_tokens": 400, **extra}


async def _whole_and_events(server, body: dict) -> tuple[dict, list[dict]]:
    """The response and the stream's events, each as the openai SDK's own models read them, strictly."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    whole_body, request = responses.parse_request(json.dumps(body).encode())
    whole = await response_stream.whole_response(whole_body, server.serving.chat_stream(request), "resp_1", 0)
    stream_body, streamed = responses.parse_request(json.dumps({**body, "stream": True}).encode())
    events = [e async for e in response_stream.response_events(stream_body, server.serving.chat_stream(streamed), "resp_2", 0)]
    Response.model_validate(whole, strict=True)
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event, strict=True)
    return whole, events


ANSWER = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


async def test_an_answer_with_text_and_a_call_is_a_message_item_and_a_function_call_item_streamed_or_not(tools_server):
    whole, events = await _whole_and_events(tools_server, _replayed(ANSWER))
    assert whole["status"] == "completed" and [item["type"] for item in whole["output"]] == ["message", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == "Let me check."
    call = whole["output"][1]
    assert (call["name"], call["arguments"], call["call_id"].startswith("call_")) == ("get_weather", '{"city": "Oslo"}', True)
    assert whole["usage"]["input_tokens"] > 0 and whole["usage"]["output_tokens"] == len(ANSWER.encode())
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert kinds.count("response.output_text.delta") > 5 and kinds.count("response.function_call_arguments.delta") > 3
    final = events[-1]["response"]
    assert (text, arguments) == ("Let me check.", '{"city": "Oslo"}')  # the deltas join to the items
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in final["output"]] == \
           [(i["type"], i.get("name"), i.get("arguments")) for i in whole["output"]]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"] == whole["usage"]
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"
    # each item is done before the next is added, and its id stays from added to done
    message_done = kinds.index("response.output_item.done")
    call_added = [i for i, e in enumerate(events) if e["type"] == "response.output_item.added"][1]
    assert message_done < call_added and events[call_added]["item"]["id"] == final["output"][1]["id"]


async def test_text_after_a_call_is_a_message_item_after_the_call_item_streamed_or_not(tools_server):
    answer = ANSWER + " I will tell you when it answers."
    whole, events = await _whole_and_events(tools_server, _replayed(answer))
    items = [(item["type"], item.get("name"), item["content"][0]["text"] if item["type"] == "message" else item["arguments"])
             for item in whole["output"]]
    assert items == [("message", None, "Let me check."), ("function_call", "get_weather", '{"city": "Oslo"}'),
                     ("message", None, "I will tell you when it answers.")]
    def alike(output: list[dict]) -> list[dict]:  # each answer has ids of its own
        return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in output]

    assert alike(events[-1]["response"]["output"]) == alike(whole["output"])


async def test_logprobs_of_tokens_without_text_of_their_own_stay_with_the_message_whole_or_streamed():
    """A character's first bytes (a token of no text yet) and the end: their logprobs are the message's, as the chat
    answer's are, in the whole response and in the stream's last event."""
    def entry(token: str) -> dict:
        return {"logprobs": {"content": [{"token": token, "logprob": -0.5, "bytes": None, "top_logprobs": []}]}}

    async def chunks():
        for delta, token, finish in (({"content": ""}, "\\xf0\\x9f", None), ({"content": "\U0001f600"}, "\\x98\\x80", None),
                                     ({}, "<eos>", "stop")):
            yield {"model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **entry(token)}]}

    whole = await response_stream.whole_response({"model": "m"}, chunks(), "resp_1", 0)
    events = [e async for e in response_stream.response_events({"model": "m"}, chunks(), "resp_2", 0)]
    for response in (whole, events[-1]["response"]):
        [message] = response["output"]
        assert [lp["token"] for lp in message["content"][0]["logprobs"]] == ["\\xf0\\x9f", "\\x98\\x80", "<eos>"]
    deltas = [lp["token"] for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert deltas == ["\\xf0\\x9f", "\\x98\\x80", "<eos>"]  # each once in the deltas too, as the chat stream sends them


@pytest.mark.parametrize("given", ["false", 1, "yes"])
def test_stream_must_be_a_boolean(given):
    with pytest.raises(APIError, match="stream must be true or false"):
        responses.parse_request(json.dumps({"model": "m", "input": "Hi", "stream": given}).encode())


async def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed():
    async def chunks():
        yield {"model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, "logprobs": None}]}
        raise RuntimeError("engine gone")

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events = [e async for e in response_stream.response_events({"model": "m"}, chunks(), "resp_1", 0, "req-1")]
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and "engine gone" not in json.dumps(events)  # no internals
    for event in events:  # response.failed's error.code: one of the few the Responses type allows
        TypeAdapter(ResponseStreamEvent).validate_python(event, strict=True)
    assert (events[-2]["code"], events[-1]["response"]["error"]["code"]) == ("internal_error", "server_error")


@pytest.mark.parametrize("remote", [False, True])  # True: a model on another replica, its error wrapped by Ray
@pytest.mark.parametrize("began", [False, True])
async def test_the_models_400_names_the_response_requests_fields_before_the_stream_began_or_after(began, remote):
    from ray.exceptions import RayTaskError

    from app.api.errors import to_api_error

    def failure():
        error = APIError(400, "the prompt has 9 tokens and max_tokens asks for 9000. Lower max_tokens", param="max_tokens")
        return RayTaskError("LLMServer.chat_stream", "Traceback ...", error).as_instanceof_cause() if remote else error

    async def chunks():
        if began:
            yield {"model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, "logprobs": None}]}
        raise failure()

    events = response_stream.response_events({"model": "m"}, chunks(), "resp_1", 0, "req-1")
    if began:
        error = [e async for e in events][-2]
        assert (error["type"], error["param"]) == ("error", "max_output_tokens") and "max_tokens" not in error["message"]
    else:
        with pytest.raises(Exception) as raised:
            [e async for e in events]
        sent = to_api_error(raised.value)  # what the client reads
        assert sent.param == "max_output_tokens" and "Lower max_output_tokens" in sent.message
    with pytest.raises(Exception) as raised:  # the whole response alike
        await response_stream.whole_response({"model": "m"}, chunks(), "resp_2", 0)
    assert to_api_error(raised.value).param == "max_output_tokens"


async def test_logprobs_asked_by_include_come_with_the_text_streamed_or_not(tools_server):
    whole, events = await _whole_and_events(tools_server, _replayed("Sunny.", include=["message.output_text.logprobs"], top_logprobs=1))
    logprobs = whole["output"][0]["content"][0]["logprobs"]
    assert [lp["token"] for lp in logprobs] == list("Sunny.") and all(lp["logprob"] < 0 for lp in logprobs)  # a byte a token
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in logprobs]


async def test_an_answer_cut_by_max_output_tokens_is_incomplete_streamed_or_not(tools_server):
    whole, events = await _whole_and_events(tools_server, _replayed("It is sunny in Oslo today.", max_output_tokens=5))
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["content"][0]["text"] == "It is"
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"][0]["content"][0]["text"] == "It is"


def test_max_tool_calls_bounds_built_in_tools_alone_so_it_is_taken_and_echoed():
    """OpenAI's max_tool_calls counts calls of built-in tools, which are refused here: function calls are as without it."""
    body = {"model": "m", "input": "Weather?", "tools": [WEATHER], "max_tool_calls": 1}
    chat = responses.chat_body(body)
    assert chat == responses.chat_body({k: v for k, v in body.items() if k != "max_tool_calls"})
    assert responses.response_dict(body, "resp_1", 0, "m", "completed", [], None)["max_tool_calls"] == 1


def test_vllms_response_extras_and_openais_defaults_are_taken_as_the_chat_request_takes_them():
    """vLLM's Responses extras reach the chat request; OpenAI's defaults sent explicitly (tool_choice "auto" without
    tools, a summary asked for, medium verbosity, tools not deferred) change nothing; request_id is the response's id."""
    extras = {"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False, "skip_special_tokens": False,
              "include_stop_str_in_output": True, "stop_token_ids": [7], "cache_salt": "tenant-1", "priority": 0,
              "structured_outputs": {"regex": "[a-z]+"}, "request_id": "job-42"}
    body = {"model": "m", "input": "Hi", "tool_choice": "auto", "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"verbosity": "medium"}, **extras}
    _, chat = responses.parse_request(json.dumps(body).encode())
    assert {key: getattr(chat, key) for key in extras} == extras and chat.tool_choice is None
    assert chat.reasoning_effort == "low"
    assert responses.new_ids(body)[0] == "job-42" and responses.new_ids({})[0].startswith("resp_")
    _, tooled = responses.parse_request(json.dumps({"model": "m", "input": "Hi", "tools": [{**WEATHER, "defer_loading": False}],
                                                    "tool_choice": "auto"}).encode())
    assert tooled.tool_choice == "auto" and [t.name for t in tooled.parsed_tools()] == ["get_weather"]


async def test_each_messages_logprobs_are_its_texts_tokens_not_a_calls_markup(tools_server):
    answer = ANSWER + " I will tell you when it answers."
    whole, events = await _whole_and_events(tools_server, _replayed(answer, include=["message.output_text.logprobs"]))
    for response in (whole, events[-1]["response"]):
        messages = [item["content"][0] for item in response["output"] if item["type"] == "message"]
        assert [part["text"] for part in messages] == ["Let me check.", "I will tell you when it answers."]
        for part in messages:  # a byte a token
            assert "".join(lp["token"] for lp in part["logprobs"]).strip() == part["text"]


async def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item_streamed_or_not(tools_server):
    cut = ANSWER.index("Oslo") + 2
    whole, events = await _whole_and_events(tools_server, _replayed(ANSWER, max_output_tokens=cut))
    for response in (whole, events[-1]["response"]):
        assert response["status"] == "incomplete" and [i["type"] for i in response["output"]] == ["message", "function_call"]
        assert [i["status"] for i in response["output"]] == ["completed", "incomplete"]


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "name": "get_weather", "arguments": "{}"}, "input[1].call_id"),
    ({"type": "function_call", "call_id": "c1", "arguments": "{}"}, "input[1].name"),
    ({"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": 5}, "input[1].arguments"),
    ({"type": "function_call_output", "call_id": 5, "output": "sunny"}, "input[1].call_id"),
])
def test_a_call_item_missing_a_field_is_a_400_naming_the_item(item, param):
    body = {"model": "m", "instructions": "Be brief.", "input": [{"role": "user", "content": "Weather?"}, item]}
    with pytest.raises(APIError) as raised:
        responses.chat_body(body)
    assert (raised.value.status, raised.value.param) == (400, param)
