"""The Responses API through the real app, HTTP and the real openai SDK: its objects, its stream (read by the SDK's
own accumulating helper) and its 400s; the fake model replays a recorded answer, the embedded model answers one."""

import openai
import pytest

from tests.serve.conftest import BASE, FAKE_BASE, FAKE_MODELS, MODEL
from tests.serve.fake_model import REPLAY

pytestmark = pytest.mark.serve

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RECORDED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_sdk_reads_a_response_and_its_stream_to_the_same_text_and_call(fake_app):
    client = openai.OpenAI(base_url=f"{FAKE_BASE}/v1", api_key="unused")
    kwargs = dict(model=FAKE_MODELS[0], tools=[WEATHER], max_output_tokens=500, instructions="Answer briefly.",
                  input=[{"role": "user", "content": (REPLAY[0] + RECORDED.encode() + REPLAY[1]).decode()}])
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and whole.output_text == "Let me check."
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    with client.responses.stream(**kwargs) as stream:  # the SDK's helper rebuilds the response from the events
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and "response.function_call_arguments.delta" in kinds
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [(call.name, call.arguments)]


def test_the_embedded_model_answers_and_what_cannot_be_done_is_a_400(serve_app):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")
    answer = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12, temperature=0)
    assert "Paris" in answer.output_text and answer.usage.output_tokens <= 12
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=answer.id)
    with pytest.raises(openai.NotFoundError, match="keeps no responses"):
        client.responses.retrieve(answer.id)
