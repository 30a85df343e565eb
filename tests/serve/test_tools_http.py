"""Tool calling through the real app and the real openai SDK, on the embedded model (whose chat template renders
no tools: the server writes them, and earlier calls and results, in the Hermes format)."""

import json

import openai
import pytest

from tests.serve.conftest import BASE, FAKE_BASE, FAKE_MODELS, MODEL
from tests.serve.fake_model import REPLAY

pytestmark = pytest.mark.serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]


@pytest.fixture(scope="module")
def oai(serve_app):
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")


def _valid(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str) and arguments["unit"] in ("celsius", "fahrenheit")
    return call.function.name == "get_time" and set(arguments) == {"timezone"} and isinstance(arguments["timezone"], str)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_always_validate_over_20_sampled_runs(oai, tool_choice):
    answer = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, n=20,
                                         temperature=1.0, max_tokens=60, parallel_tool_calls=False)
    for choice in answer.choices:
        calls = choice.message.tool_calls
        finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # a named function stops (OpenAI, vLLM)
        assert choice.finish_reason == finish and len(calls) == 1 and _valid(calls[0]), choice.message
        if isinstance(tool_choice, dict):
            assert calls[0].function.name == "get_time"


def test_streamed_tool_call_deltas_assemble_to_the_non_streamed_call(oai):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    _, calls, finish = _streamed_calls(oai.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_answers_with_content_or_calls_that_validate(oai):
    answer = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60).choices[0]
    if answer.message.tool_calls:
        assert answer.finish_reason == "tool_calls" and all(c.function.name == "get_weather" for c in answer.message.tool_calls)
    else:
        assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_a_three_turn_transcript_with_a_call_and_its_result_renders_and_answers(oai):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12, "sky": "sunny"}'}]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=30).choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")


RECORDED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def test_auto_reads_a_recorded_hermes_call_end_to_end_streamed_and_not(fake_app):
    """The fake model replays a recorded Hermes answer: the app's parser turns it into an OpenAI tool call."""
    fake = openai.OpenAI(base_url=f"{FAKE_BASE}/v1", api_key="unused")
    kwargs = dict(model=FAKE_MODELS[0], tools=[WEATHER], max_tokens=500,
                  messages=[{"role": "user", "content": (REPLAY[0] + RECORDED.encode() + REPLAY[1]).decode()}])
    whole = fake.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}
    content, calls, finish = _streamed_calls(fake.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, finish) == ("Let me check.", [("get_weather", call.function.arguments)], "tool_calls")


def test_auto_with_parallel_tool_calls_false_keeps_the_first_of_two_recorded_calls(fake_app):
    fake = openai.OpenAI(base_url=f"{FAKE_BASE}/v1", api_key="unused")
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Oslo"}}\n</tool_call>'
    recorded = (REPLAY[0] + (RECORDED + second).encode() + REPLAY[1]).decode()
    kwargs = dict(model=FAKE_MODELS[0], tools=[WEATHER, TIME], max_tokens=500, messages=[{"role": "user", "content": recorded}])
    both = fake.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [call.function.name for call in both] == ["get_weather", "get_time"]
    [first] = fake.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message.tool_calls
    assert first.function.name == "get_weather"
