"""A streamed chat with tools on the real serving layer over the fake model (no Ray, tests/unit/conftest.py): content
goes out as it comes, each call as it is written, and it all assembles to the non-streamed answer."""

from __future__ import annotations

import json

import pytest

from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.tool_streams import StreamedCalls
from app.config import AppConfig
from tests.serve.fake_model import REPLAY, fake_model_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ANSWER = 'Let me check the weather. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


async def _whole_and_streamed(server, body: dict) -> tuple[dict, list[dict]]:
    """The answer's choice in one piece and the same answer's chunks, generated side by side (the fake model steps
    them together: half the wall time of one after the other)."""
    import asyncio

    async def streamed():
        return [c async for c in server.serving.chat_stream(parse_body({**body, "stream": True}, ChatCompletionRequest))]

    whole, chunks = await asyncio.gather(server.serving.chat(parse_body(body, ChatCompletionRequest)), streamed())
    return whole["choices"][0], chunks


def _body(answer: str = ANSWER, **extra) -> dict:
    content = f"Weather in Oslo? {REPLAY[0].decode()}{answer}{REPLAY[1].decode()}"  # the fake model answers this
    return {"messages": [{"role": "user", "content": content}], "tools": [WEATHER], "max_tokens": 400, **extra}


def _assembled(entries: list[dict]) -> list[tuple[str, str]]:
    """A stream's ``delta.tool_calls`` entries joined by index: (name, arguments) per call."""
    calls = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"name": entry["function"].get("name"), "arguments": ""})
        call["arguments"] += entry["function"]["arguments"]
    return [(c["name"], c["arguments"]) for c in calls.values()]


async def test_content_streams_before_the_call_and_the_call_as_it_is_written_and_all_assembles_to_the_whole_answer(tools_server):
    whole, chunks = await _whole_and_streamed(tools_server, _body())
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    content_chunks = [d["delta"]["content"] for d in deltas if d["delta"].get("content")]
    assert len(content_chunks) > 10  # token by token, not one piece at the end
    entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert len(entries) > 3 and entries[0]["id"].startswith("call_")  # its name, then its arguments as they come
    assert all(set(e) == {"index", "function"} for e in entries[1:])
    assert "".join(content_chunks) == whole["message"]["content"] == "Let me check the weather."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert _assembled(entries) == calls == [("get_weather", '{"city": "Oslo"}')]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("max_tokens, arguments", [(60, None), (80, '{"city'), (88, '{"city": "Oslo')])
async def test_a_call_cut_short_is_a_call_as_far_as_it_came_streamed_or_not(tools_server, max_tokens, arguments):
    """Cut by max_tokens (the fake model writes a byte a token) inside its arguments, a call is one in both forms,
    its arguments as far as they came (as OpenAI answers); cut before them, the text is content in both."""
    whole, chunks = await _whole_and_streamed(tools_server, _body(max_tokens=max_tokens))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])]
    assert _assembled(entries) == calls == ([("get_weather", arguments)] if arguments else [])
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "length"


@pytest.mark.parametrize("parser, pieces, released, calls", [
    ("hermes", ["Hi ", "<to", "ol_call>", '{"name": "f", "arguments": {}}</tool_call>'], ["Hi", "", "", ""], ["f"]),
    ("hermes", ["a <to", "p> b"], ["a", " <top> b"], []),  # the start of a marker that was not one goes out late
    ("llama3_json", [" ", '{"name": "f", "parameters": {}}'], ["", ""], ["f"]),  # an answer opening as JSON: held
    ("llama3_json", ["Hi", " there"], ["Hi", " there"], []),
    ("mistral", ["ok ", "[TOOL_", 'CALLS][{"name": "f", "arguments": {}}]'], ["ok", "", ""], ["f"]),
    ("hermes", ["one ", "two "], ["one", " two"], []),  # whitespace waits for what follows it
])
def test_text_is_held_only_where_a_call_may_begin(parser, pieces, released, calls):
    stream = StreamedCalls(parser)
    assert [stream.feed(piece) for piece in pieces] == released
    assert [call.name for call in stream.finish()[1]] == calls


NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '\n {"city": "Oslo",  "unit": "celsius"} \n'  # the model's own spacing, inside and around


@pytest.mark.parametrize("extra", [{}, {"logprobs": True}, {"max_tokens": 9}])
async def test_a_named_functions_arguments_stream_as_they_come_and_assemble_to_the_whole_call(tools_server, extra):
    """As vLLM streams a named tool_choice: the call's id and name with its first fragment, then fragment by fragment;
    the fragments join to the non-streamed call's arguments (the model's text, whitespace around it left out; cut
    short by max_tokens, as far as it got, finishing "length" either way)."""
    body = _body(ARGUMENTS, tool_choice=NAMED, **extra)
    whole, chunks = await _whole_and_streamed(tools_server, body)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [entry for d in deltas for entry in d["delta"].get("tool_calls", [])]
    assert len(entries) > 5 and not any(d["delta"].get("content") for d in deltas)
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == "get_weather"
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries[1:])
    call = whole["message"]["tool_calls"][0]
    cut = "max_tokens" in extra
    expected = ARGUMENTS[:extra["max_tokens"]].strip() if cut else ARGUMENTS.strip()
    assert "".join(e["function"]["arguments"] for e in entries) == call["function"]["arguments"] == expected
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == ("length" if cut else "stop")


@pytest.mark.parametrize("tool_choice, answer", [
    ("auto", ANSWER), ("required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'), (NAMED, ARGUMENTS)])
async def test_a_streamed_tool_answer_carries_every_tokens_logprob_as_the_whole_answer(tools_server, tool_choice, answer):
    """The call's tokens keep their logprobs in the stream (on the calls' chunk), as the non-streamed answer gives
    them: a client summing a stream's logprobs gets the answer's."""
    body = _body(answer, logprobs=True, top_logprobs=1, tool_choice=tool_choice)
    whole, chunks = await _whole_and_streamed(tools_server, body)
    streamed = [entry for c in chunks if c["choices"] for entry in (c["choices"][0]["logprobs"] or {}).get("content") or []]
    assert len(whole["logprobs"]["content"]) > 20 and streamed == whole["logprobs"]["content"]
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks if c["choices"]) == 1


async def test_qwen3_coder_calls_stream_and_assemble_to_the_whole_answer_typed_by_the_schema(quick_fake_steps):
    served = {"model": {"source": "fake-tools", "tool_parser": "qwen3_coder"}, "engine": {"separate_process": False}}
    coder = fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    try:
        answer = ("On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n"
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
        body = _body(answer)
        whole, chunks = await _whole_and_streamed(coder, body)
    finally:
        coder.shutdown(timeout_s=1)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"] == "On it."
    assert [e["function"]["arguments"] for e in entries] == ["{", '"city": "1984"', ', "unit": "celsius"', "}"]  # as they come
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert _assembled(entries) == calls and json.loads(calls[0][1]) == {"city": "1984", "unit": "celsius"}  # text, as its schema says
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"


REQUIRED = '[{"name": "get_weather", "arguments": {"city": "Oslo",  "note": "a \\"}\\" brace"}}, {"name": "get_weather", "arguments": {}}]'


@pytest.mark.parametrize("max_tokens", [400, 60])
async def test_required_calls_stream_as_they_come_and_assemble_to_the_whole_answer(tools_server, max_tokens):
    """As vLLM streams tool_choice required: each call once its name is whole (index, id, name), then its arguments'
    fragments; the model's text as written (a brace inside a string is no end); cut short, as far as it came."""
    body = _body(REQUIRED, tool_choice="required", max_tokens=max_tokens)
    whole, chunks = await _whole_and_streamed(tools_server, body)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [entry for d in deltas for entry in d["delta"].get("tool_calls", [])]
    assert len(entries) > 10 and not any(d["delta"].get("content") for d in deltas)
    streamed = {}
    for entry in entries:
        call = streamed.setdefault(entry["index"], {"id": entry.get("id"), "name": entry["function"].get("name"), "arguments": ""})
        call["arguments"] += entry["function"]["arguments"]
    calls = whole["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    cut = max_tokens < len(REQUIRED)
    if not cut:
        assert [json.loads(c["arguments"]) for c in streamed.values()] == [{"city": "Oslo", "note": 'a "}" brace'}, {}]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == ("length" if cut else "tool_calls")


async def test_a_required_call_cut_short_before_its_name_is_whole_is_the_same_content_streamed_or_not(tools_server):
    whole, chunks = await _whole_and_streamed(tools_server, _body(REQUIRED, tool_choice="required", max_tokens=12))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas) and "tool_calls" not in whole["message"]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"] == REQUIRED[:12]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "length"


def test_a_json_format_beside_tools_under_auto_reaches_the_engine_as_an_answer_or_calls(tools_server):
    import llguidance

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = _body(response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    [plan] = tools_server.serving._chat_plans(parse_body(body, ChatCompletionRequest))
    for text in ('{"city": "Oslo"}', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'):
        matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), plan.sampling.grammar)
        assert matcher.consume_tokens(list(text.encode())) and matcher.is_accepting(), text


async def test_a_non_streamed_answers_logprobs_are_formatted_off_the_event_loop(tools_server, monkeypatch):
    """An echoed 8k-token prompt's logprobs with 20 alternatives each took 1 s to format: on the event loop, every
    stream of the replica would wait. Formatting here waits for a task on the loop, which runs only if it is free."""
    import asyncio
    import threading

    loop_ran = threading.Event()
    formatter = tools_server.serving.logprob_format
    original = formatter.chat

    def slow_chat(logprobs, as_ids=False):
        assert loop_ran.wait(5), "the event loop was held while formatting"
        return original(logprobs)

    async def on_the_loop():
        await asyncio.sleep(0.05)  # after the answer's tokens are in: while it is formatted
        loop_ran.set()

    monkeypatch.setattr(formatter, "chat", slow_chat)
    body = parse_body(_body("Sunny.", logprobs=True, top_logprobs=2), ChatCompletionRequest)
    answer, _ = await asyncio.gather(tools_server.serving.chat(body), on_the_loop())
    assert answer["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("tool_choice, answer", [
    ("auto", 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Os'),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Os'),
])
async def test_an_answer_a_stop_ended_inside_a_call_makes_no_call_and_finishes_stop(tools_server, tool_choice, answer):
    """A stop string (here: the recorded answer's end, which the fake model finishes as "stop") ending an answer inside a
    call's arguments: no call is made (the text is the content, not arguments that do not parse under a finish that
    says the call is whole); a stream has sent the fragments as they came, and also finishes "stop"."""
    whole, chunks = await _whole_and_streamed(tools_server, _body(answer, tool_choice=tool_choice))
    assert whole["finish_reason"] == "stop" and "tool_calls" not in whole["message"]
    assert whole["message"]["content"] == answer
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_with_parallel_tool_calls_false_a_second_call_cut_short_leaves_the_first_and_its_finish(tools_server):
    """The answer keeps its first call; a second one the model began and did not finish is dropped, so it cannot make
    the finish "stop" in the stream when the whole answer's is "tool_calls" (an agent loop runs the tool on it)."""
    cut = ANSWER + '<tool_call>{"name": "get_weather", "arguments": {"city": "Ro'
    whole, chunks = await _whole_and_streamed(tools_server, _body(cut, parallel_tool_calls=False))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    entries = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert _assembled(entries) == [("get_weather", '{"city": "Oslo"}')] and len(whole["message"]["tool_calls"]) == 1
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"
