"""vLLM's /tokenize and /detokenize on the real serving layer over the fake model: a prompt's and a chat's token ids
are the ones generation would send, and token ids read back as their text."""

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.token_requests import DetokenizeRequest, TokenizeRequest
from app.config import AppConfig
from tests.serve.fake_model import fake_model_server

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def serving():
    served = {"model": {"source": "fake-tools"}, "engine": {"separate_process": False}}
    server = fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    yield server.serving
    server.shutdown(timeout_s=1)


async def test_a_prompt_and_a_chat_tokenize_as_generation_sends_them(serving):
    answer = await serving.tokenize(parse_body({"prompt": "Hi there", "return_token_strs": True}, TokenizeRequest))
    assert answer["tokens"] == serving.tokenizer.encode("Hi there", add_special_tokens=True) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == serving.max_model_len and len(answer["token_strs"]) == answer["count"]
    chat = await serving.tokenize(parse_body({"messages": CHAT, "tools": [WEATHER]}, TokenizeRequest))
    assert chat["tokens"] == serving.prompts.chat(parse_body({"messages": CHAT, "tools": [WEATHER]}, ChatCompletionRequest))
    for fields in ({"tool_choice": "none"}, {"tool_choice": "required", "parallel_tool_calls": False}):  # its prompt, as sent
        body = {"messages": CHAT, "tools": [WEATHER], **fields}
        counted = await serving.tokenize(parse_body(body, TokenizeRequest))
        assert counted["tokens"] == serving.prompts.chat(parse_body(body, ChatCompletionRequest))
    none = await serving.tokenize(parse_body({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}, TokenizeRequest))
    assert none["count"] < chat["count"]  # a template that renders no tools shows none under tool_choice none
    bare = await serving.tokenize(parse_body({"messages": CHAT, "add_generation_prompt": False}, TokenizeRequest))
    assert bare["count"] < (await serving.tokenize(parse_body({"messages": CHAT}, TokenizeRequest)))["count"]


async def test_token_ids_read_back_as_their_text_and_bad_ones_are_a_400(serving):
    ids = serving.tokenizer.encode("Oslo is sunny", add_special_tokens=False)
    assert (await serving.detokenize(parse_body({"tokens": ids}, DetokenizeRequest)))["prompt"] == "Oslo is sunny"
    with pytest.raises(APIError, match="token ids must be in"):
        await serving.detokenize(parse_body({"tokens": [serving.vocab_size]}, DetokenizeRequest))
    for body in ({"prompt": "a", "messages": CHAT}, {}):
        with pytest.raises(APIError, match="either prompt or messages"):
            parse_body(body, TokenizeRequest)


def test_a_developer_message_is_a_system_one_to_a_template_without_the_role_and_text_parts_are_lines(serving):
    """OpenAI's newer clients send instructions as ``developer``; SmolLM2's template knows no such role (it would
    add its own default system prompt and show the model an unknown turn). Text parts join as lines, as vLLM's."""
    def ids(messages: list[dict]) -> list[int]:
        return serving.prompts.chat(parse_body({"messages": messages}, ChatCompletionRequest))

    assert "developer" not in serving.tokenizer.chat_template
    assert ids([{**CHAT[0], "role": "developer"}, CHAT[1]]) == ids(CHAT)
    parts = [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]
    assert ids([CHAT[0], {"role": "user", "content": parts}]) == ids([CHAT[0], {"role": "user", "content": "Weather\nin Oslo?"}])
