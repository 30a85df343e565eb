"""Chat templates that take more than a string per message, or less: each renders what the client sent (no 400,
nothing silently left out). llava-hf's loops over content parts; Gemma 2's refuses a system role and anything
but user and model turns in turn; Mistral's takes tool call ids of 9 characters only."""

import re

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from app.api.errors import APIError
from app.api.prompts import Prompts
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.template_traits import TemplateTraits, short_call_id, traits_of
from tests.unit.chat_templates import GEMMA2, LLAVA, MISTRAL, PHI4_MINI

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_384186122e8a4206b192c35f", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TRANSCRIPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo and Rome?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
              {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"},
              {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


def _prompts(template: str, rendered: list[str]) -> Prompts:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                        unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = template
    tokenizer.encode = lambda text, add_special_tokens=True: rendered.append(text) or [0]  # the text is what is tested
    return Prompts(tokenizer, "m", 64, 1)


def _render(template: str, **body) -> str:
    rendered = []
    _prompts(template, rendered).chat(parse_body(body, ChatCompletionRequest))
    return rendered[-1]


@pytest.mark.parametrize("content", ["What is the capital of France?",
                                     [{"type": "text", "text": "What is the capital of France?"}]])
def test_a_template_reading_content_parts_gets_the_text_as_one(content):
    assert _render(LLAVA, messages=[{"role": "user", "content": content}]) == "USER: What is the capital of France? ASSISTANT:"


def test_a_template_without_a_system_role_gets_the_system_message_in_the_first_user_turn():
    text = _render(GEMMA2, messages=TRANSCRIPT[:2])
    assert text == "<s><start_of_turn>user\nAnswer briefly.\n\nWeather in Oslo and Rome?<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tools_on_a_template_without_system_or_tool_roles_are_shown_and_results_are_user_turns(tool_choice):
    text = _render(GEMMA2, messages=TRANSCRIPT, tools=WEATHER, tool_choice=tool_choice)
    turns = re.findall(r"<start_of_turn>(\w+)\n", text)
    assert turns == ["user", "model", "user", "model"]  # the results, one turn: the roles alternate
    first_user = text.split("<end_of_turn>")[0]
    assert "Answer briefly." in first_user and '"name": "get_weather"' in first_user and "Weather in Oslo" in first_user
    assert "<tool_response>\nsunny\n</tool_response>\n\n<tool_response>\nrain\n</tool_response>" in text


def test_mistral_templates_get_nine_character_call_ids_the_same_for_a_call_and_its_result():
    text = _render(MISTRAL, messages=TRANSCRIPT[1:], tools=WEATHER)
    first, second = short_call_id(CALL["id"]), short_call_id("call_2")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", first) and first != second
    assert f'"id": "{first}"' in text and f'"call_id": "{first}"' in text and f'"call_id": "{second}"' in text
    assert short_call_id("a1B2c3D4e") == "a1B2c3D4e"  # one of Mistral's own stays


def test_the_traits_are_probed_once_per_template():
    prompts = _prompts(GEMMA2, [])
    traits = traits_of(prompts.tokenizer)
    assert (traits.system_role, traits.tool_role, traits.content_as_parts, traits.short_call_ids) == (False, False, False, False)
    assert traits_of(prompts.tokenizer) is traits
    prompts.tokenizer.chat_template = MISTRAL  # its tool messages need a call id of its shape: the probe's has one
    assert traits_of(prompts.tokenizer) == TemplateTraits(system_role=True, tool_role=True, short_call_ids=True, several_system=False)
    prompts.tokenizer.chat_template = "{{ raise_exception('needs a variable the probes do not pass') }}"
    assert traits_of(prompts.tokenizer) == TemplateTraits()  # nothing learnt: the messages go as they are


def test_several_leading_system_messages_open_the_first_user_turn_together():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use metric units."},
                {"role": "user", "content": "Weather?"}]
    text = _render(GEMMA2, messages=messages)
    assert text == "<s><start_of_turn>user\nBe brief.\n\nUse metric units.\n\nWeather?<end_of_turn>\n<start_of_turn>model\n"


ITEMS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} {{ c.function.name }}("
         "{% for k, v in c.function.arguments|items %}{{ k }}={{ v }}{% endfor %}){% endfor %}{{ '\\n' }}{% endfor %}"
         "{% for t in tools or [] %}tool: {{ t.function.name }}\n{% endfor %}")  # it shows the tools: calls as it writes them


@pytest.mark.parametrize("arguments, shown", [('{"city": "Oslo"}', "get_weather(city=Oslo)"),
                                              ({"city": "Oslo"}, "get_weather(city=Oslo)"),  # an object, as some clients send
                                              (None, "get_weather()"), ("", "get_weather()"),
                                              ('{"city": "Os', "get_weather()")])  # this server's call cut by max_tokens
def test_an_earlier_calls_arguments_reach_a_template_iterating_them_as_an_object(arguments, shown):
    call = {**CALL, "function": {"name": "get_weather", "arguments": arguments}}
    text = _render(ITEMS, messages=[{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}], tools=WEATHER)
    assert f"assistant:  {shown}" in text


def test_arguments_of_another_type_are_a_400_naming_them():
    call = {**CALL, "function": {"name": "get_weather", "arguments": 5}}
    with pytest.raises(APIError) as raised:
        _render(ITEMS, messages=[{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert raised.value.param == "messages.tool_calls[0].function.arguments"


@pytest.mark.parametrize("part", [{"type": "refusal", "refusal": "I can't help with that."},
                                  {"type": "output_text", "text": "I can't help with that."}])
def test_an_assistants_refusal_or_output_text_part_replayed_is_its_text(part):
    text = _render(ITEMS, messages=[{"role": "user", "content": [{"type": "input_text", "text": "Help?"}]},
                                    {"role": "assistant", "content": [part]}, {"role": "user", "content": "Ok"}])
    assert text == "user: Help?\nassistant: I can't help with that.\nuser: Ok\n"


def test_a_template_that_names_tools_but_never_shows_them_gets_them_and_earlier_calls_as_text():
    """Phi-4-mini's template names "tools" (a system message's own field): it is asked, not read, whether it shows the
    tools it is passed; it shows none, so they, the earlier call and its result are Hermes text."""
    text = _render(PHI4_MINI, messages=TRANSCRIPT, tools=WEATHER)
    assert '"name": "get_weather"' in text.split("<|end|>")[0]  # the tools, in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_second_system_message_joins_the_first_where_the_template_takes_one_only():
    """A Responses request's instructions and a developer item, on Mistral's template (one system message, or it
    raises): one system message, a blank line apart; on a template that takes several, as given."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use metric units."},
                {"role": "user", "content": "Weather?"}]
    assert _render(MISTRAL, messages=messages) == "<s>[INST] Be brief.\n\nUse metric units.\n\nWeather?[/INST]"
    several = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert _render(several, messages=messages) == "<system>Be brief.<system>Use metric units.<user>Weather?"
    last_only = ("{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"  # keeps the last
                 "{% set ns.system = m.content %}{% endif %}{% endfor %}{{ ns.system }}|{{ messages[-1].content }}")
    assert _render(last_only, messages=messages) == "Be brief.\n\nUse metric units.|Weather?"
