"""Tool calling's pure parts: tools and tool_choice checked, the forced-call schemas, each parser on recorded
model texts, and the Hermes rendering for templates without tools."""

import json

import llguidance
import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.structured import request_format
from app.api.tools import (answer_or_calls, forced_calls, forced_schema, parse_calls, parse_tools, render_for_template,
                           resolve_choice, strict_calls)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}]}

# Recorded answers, one per format: what the models that write each one produce.
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'  # tokenizers v11 on


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", HERMES, "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama3_json", LLAMA3, None, [("get_weather", {"city": "Oslo"})]),
    ("mistral", MISTRAL, None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("mistral", MISTRAL_V11, None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("hermes", "It is sunny in Oslo.", "It is sunny in Oslo.", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),  # unreadable: stays content
    ("llama3_json", "{no", "{no", []),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
])
def test_each_parser_reads_its_recorded_format_and_keeps_what_is_not_a_call(parser, text, content, calls):
    found_content, found = parse_calls(text, parser)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert len({c.id for c in found}) == len(found) and all(c.id.startswith("call_") for c in found)


BOOKING = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "price": {"type": "number"}, "breakfast": {"type": "boolean"},
    "guests": {"type": "array"}, "note": {"type": ["string", "null"]}, "zip": {"type": "string"}}}}}
QWEN3_CODER = ("Booking it.\n<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=nights>\n3\n</parameter>\n<parameter=price>\n99.5\n</parameter>\n<parameter=breakfast>\nTrue\n"
               "</parameter>\n<parameter=guests>\n[\"ada\", \"bob\"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
               "<parameter=zip>\n01234\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_calls_take_their_types_from_the_tools_schema():
    """Qwen3-Coder writes each parameter as raw text: the tool's schema types it (a string stays text even when it
    reads as a number, "01234"), as vLLM's qwen3_coder parser does; a parameter the schema lacks stays text."""
    content, calls = parse_calls(QWEN3_CODER, "qwen3_coder", parse_tools([BOOKING]))
    assert content == "Booking it." and [c.name for c in calls] == ["book"]
    assert json.loads(calls[0].arguments) == {"city": "New York", "nights": 3, "price": 99.5, "breakfast": True,
                                              "guests": ["ada", "bob"], "note": None, "zip": "01234", "extra": '{"a": 1}'}
    # cut short (max_tokens): a call, as far as its parameters came, as a stream sends it
    content, calls = parse_calls("<tool_call>\n<function=book>\n<parameter=city>\nOslo\n</parameter>\n<parameter=ni", "qwen3_coder", [])
    assert (content, [(c.name, c.arguments) for c in calls]) == (None, [("book", '{"city": "Oslo"')])
    assert parse_calls("<tool_call>\n<funct", "qwen3_coder", []) == ("<tool_call>\n<funct", [])  # no name yet: text


def test_tool_choice_resolves_or_is_a_400_naming_it():
    tools = parse_tools([WEATHER, TIME])
    assert resolve_choice(None, tools) == "auto" and resolve_choice(None, []) is None and resolve_choice("none", tools) is None
    assert resolve_choice({"type": "function", "function": {"name": "get_time"}}, tools).name == "get_time"
    for bad in ({"type": "function", "function": {"name": "missing"}}, "sometimes", {"type": "function"},
                {"type": "function", "function": None}, {"type": "function", "function": "get_time"}):
        with pytest.raises(APIError) as caught:
            resolve_choice(bad, tools)
        assert caught.value.param == "tool_choice"
    with pytest.raises(APIError, match="needs tools"):
        resolve_choice("required", [])
    with pytest.raises(APIError, match="unique"):
        parse_tools([WEATHER, WEATHER])
    misspelt = {"type": "function", "function": {"name": "f", "paramters": {"type": "object"}}}
    for bad, param in ((misspelt, "tools[0].function.paramters"), ({**WEATHER, "bogus": 1}, "tools[0].bogus"),
                       ({"type": "function", "function": {"name": "f", "parameters": []}}, "tools[0].function.parameters")):
        with pytest.raises(APIError) as refused:  # not a function of no arguments
            parse_tools([bad])
        assert (refused.value.status, refused.value.param) == (400, param)
    with pytest.raises(APIError, match="already constrains"):
        parse_body({**CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                   ChatCompletionRequest)



def _grammar_accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


FORECAST = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "high": {"type": "integer"}}, "required": ["city", "high"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_under_auto_a_response_format_holds_the_answer_and_leaves_the_calls_to_their_schemas(parallel):
    """As OpenAI applies it (the Agents SDK's output type beside its tools): the answer follows the format, or the
    model calls a tool; the format alone would leave the model no way to write a call."""
    request = parse_body({**CHAT, "tools": [WEATHER, TIME], "response_format": FORECAST}, ChatCompletionRequest)
    found = request_format(request.response_format, request.structured_outputs)
    grammar = answer_or_calls(found, request.parsed_tools(), "hermes", parallel)
    assert _grammar_accepts(grammar, '{"city": "Oslo", "high": 12}') and _grammar_accepts(grammar, CALL)
    assert _grammar_accepts(grammar, CALL + "\n" + CALL) == parallel
    for wrong in ("It is sunny.", '{"city": "Oslo"}', CALL.replace("Oslo", "5").replace('"5"', "5"),
                  CALL.replace("get_weather", "get_news")):
        assert not _grammar_accepts(grammar, wrong)


@pytest.mark.parametrize("parallel", [True, False])
def test_under_auto_a_strict_tools_calls_follow_its_schema_and_the_text_around_them_stays_free(parallel):
    """OpenAI's strict mode (the openai Agents SDK sets it on every function tool): the model answers in text or
    calls; every call it begins names one of the tools, a strict tool's arguments its schema, another's any object."""
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    request = parse_body({**CHAT, "tools": [strict_weather, TIME]}, ChatCompletionRequest)
    grammar = strict_calls(request.parsed_tools(), "hermes", parallel)
    any_time = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    for free in ("It is sunny.", "", "a <tool_ b", "Let me check. " + CALL, CALL + "\nI will tell you.", any_time):
        assert _grammar_accepts(grammar, free), free
    assert _grammar_accepts(grammar, CALL + "\n" + CALL) == parallel
    arguments_first = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'  # Hermes 2 Pro's
    assert _grammar_accepts(grammar, arguments_first) and not _grammar_accepts(grammar, arguments_first.replace('"Oslo"', "5"))
    for wrong in (CALL.replace('"Oslo"', "5"), CALL.replace("get_weather", "get_news"),
                  CALL.replace('"Oslo"}', '"Oslo", "days": 3}'), "Let me check. <tool_call> the weather"):
        assert not _grammar_accepts(grammar, wrong), wrong
    assert strict_calls(parse_body({**CHAT, "tools": [WEATHER]}, ChatCompletionRequest).parsed_tools(), "hermes", parallel) is None
    assert strict_calls(request.parsed_tools(), "mistral", parallel) is None  # its calls stay the model's own
    one = {**WEATHER, "function": {**WEATHER["function"], "strict": 1}}  # equal to True, yet no boolean
    with pytest.raises(APIError, match="strict must be true or false"):
        parse_body({**CHAT, "tools": [one]}, ChatCompletionRequest).parsed_tools()


def test_under_auto_a_format_beside_calls_the_grammar_cannot_hold_is_a_400_naming_what_to_do():
    regex = parse_body({**CHAT, "tools": [WEATHER], "structured_outputs": {"regex": "[ab]"}}, ChatCompletionRequest)
    with pytest.raises(APIError, match="only a JSON format") as refused:
        answer_or_calls(request_format(None, regex.structured_outputs), regex.parsed_tools(), "hermes", True)
    assert refused.value.param == "structured_outputs.regex"
    with pytest.raises(APIError, match="this one writes mistral's"):
        answer_or_calls(request_format(FORECAST, None), regex.parsed_tools(), "mistral", True)


def _accepted(schema: dict, text: str) -> bool:
    """Whether the grammar of ``schema`` (as requests get it) accepts ``text`` whole."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False,
                                                                             "item_separator": ", ", "key_separator": ": "})
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_required_and_named_calls_constrain_to_their_schemas():
    tools = parse_tools([WEATHER, TIME])
    named = forced_schema(tools[0], tools, parallel=True)
    assert named == {**tools[0].parameters, "additionalProperties": False}  # no keys it does not list
    assert forced_calls('{"city": "Oslo"}', tools[0])[0].name == "get_weather"
    required = forced_schema("required", tools, parallel=False)
    assert _accepted(required, '[{"name": "get_time", "arguments": {}}]')
    assert not _accepted(required, '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]')
    assert not _accepted(required, '[{"name": "unknown", "arguments": {}}]')
    assert _accepted(forced_schema("required", tools, parallel=True), '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                                                       '{"name": "get_time", "arguments": {}}]')
    calls = forced_calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert forced_calls('[{"name": "get_wea', "required") == []  # cut short: no call, the text stays content
    grammar = parse_body({**CHAT, "tools": [WEATHER], "tool_choice": "required"}, ChatCompletionRequest).sampling_params(8).grammar
    assert grammar and "get_weather" in grammar


def test_a_template_without_tools_gets_them_and_the_transcript_as_hermes_text():
    tools = parse_tools([WEATHER])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny, 12 C", "tool_call_id": "call_1"}]
    rendered = render_for_template(messages, tools)
    assert rendered[0]["role"] == "system" and '"get_weather"' in rendered[0]["content"] and "<tool_call>" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\nsunny, 12 C\n</tool_response>"}
    assert all(set(m) == {"role", "content"} for m in rendered)  # nothing a plain template cannot join


def test_a_call_whose_decoded_name_or_arguments_are_no_text_stays_content():
    """JSON's "\\ud800" escape decodes to a lone surrogate, which no response can encode: not a call."""
    text = '<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>'
    assert parse_calls(text, "hermes") == (text, [])
    text = '<tool_call>\n{"name": "get_time", "arguments": "\\udfff"}\n</tool_call>'
    assert parse_calls(text, "hermes") == (text, [])


def test_named_templates_render_tools_through_their_tool_use_template():
    """A checkpoint with named templates (Hermes 2 Pro, Command R): transformers applies ``tool_use`` when tools are
    passed; the tools go to it in the model's own format, not as the Hermes text meant for templates without tools."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from app.api.serving import OpenAIServing

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                        unk_token="[UNK]")
    turns = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.chat_template = {"default": turns, "tool_use": "TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n" + turns}
    texts = []
    tokenizer.encode = lambda text, add_special_tokens=True: texts.append(text) or [0]
    serving = OpenAIServing(None, tokenizer, "m", 64, [0], 1)
    serving.prompts.chat(parse_body({**CHAT, "tools": [WEATHER, TIME]}, ChatCompletionRequest))
    serving.prompts.chat(parse_body(CHAT, ChatCompletionRequest))
    assert texts == ["TOOLS get_weather,get_time\nuser: Weather in Oslo?\n", "user: Weather in Oslo?\n"]


def test_under_tool_choice_none_a_template_that_renders_tools_gets_them_and_no_calls_are_invited_otherwise():
    """As vLLM (its default): the model's own template shows the tools; a template without tools gets no Hermes text
    inviting calls, which tool_choice none forbids. The answer is plain content either way."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from app.api.serving import OpenAIServing

    turns = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    texts = []
    for template in ("TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n" + turns, turns):
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                            unk_token="[UNK]")
        tokenizer.chat_template = template
        tokenizer.encode = lambda text, add_special_tokens=True: texts.append(text) or [0]
        serving = OpenAIServing(None, tokenizer, "m", 64, [0], 1)
        serving.prompts.chat(parse_body({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "none"}, ChatCompletionRequest))
    assert texts == ["TOOLS get_weather,get_time\nuser: Weather in Oslo?\n", "user: Weather in Oslo?\n"]


@pytest.mark.parametrize("template, parser", [
    ("{{ bos_token }}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% if m.tool_calls %}[TOOL_CALLS]{% endif %}", "mistral"),
    ("<|start_header_id|>assistant<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("<|start_header_id|>{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}", "llama3_json"),  # Llama 3.2
    ("<|im_start|>system\n<tools>{{ tools }}</tools>{{- '<tool_call>\\n' }}", "hermes"),  # Qwen2.5, Qwen3, Hermes
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes"),  # no tools of its own: shown the Hermes way
    ({"default": "plain", "tool_use": "... [TOOL_CALLS] ..."}, "mistral"),
    ("<tools>{{ tools }}</tools>{{- '<tool_call>\\n<function=' + name + '>\\n' }}{{- '<parameter=' + key + '>' }}", "qwen3_coder"),
])
def test_auto_reads_the_call_format_off_the_chat_template(template, parser):
    from types import SimpleNamespace

    from app.api.tools import tool_parser_for

    assert tool_parser_for("auto", SimpleNamespace(chat_template=template)) == parser
    assert tool_parser_for("mistral", SimpleNamespace(chat_template=template)) == "mistral"  # as configured


def test_required_keeps_each_tools_definitions_and_its_references_to_its_own_root():
    """pydantic's nested models ($defs + $ref) and a recursive tree ("$ref": "#"): under ``required`` each tool's
    parameters sit inside one schema, their definitions at its root, "#" still their own root."""
    address = {"type": "object", "properties": {"street": {"$ref": "#/$defs/Street"}}, "$defs": {
        "Street": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["label"]}
    tools = parse_tools([{"type": "function", "function": {"name": "ship", "parameters": address}},
                         {"type": "function", "function": {"name": "plant", "parameters": tree}}])
    schema = forced_schema("required", tools, parallel=True)
    assert _accepted(schema, '[{"name": "ship", "arguments": {"street": {"name": "Main"}}}, '
                             '{"name": "plant", "arguments": {"label": "a", "children": [{"label": "b", "children": []}]}}]')
    assert not _accepted(schema, '[{"name": "plant", "arguments": {"label": "a", "children": [{"name": "plant"}]}}]')
    assert not _accepted(schema, '[{"name": "ship", "arguments": {"street": {"name": "Main", "no": 1}}}]')
    other = {"type": "object", "properties": {"street": {"$ref": "#/definitions/Street"}}, "required": ["street"],
             "definitions": {"Street": {"type": "string"}}}  # its own Street: a name of two tools, two meanings
    both = forced_schema("required", parse_tools([{"type": "function", "function": {"name": "ship", "parameters": address}},
                                                  {"type": "function", "function": {"name": "post", "parameters": other}}]), True)
    assert _accepted(both, '[{"name": "post", "arguments": {"street": "Main"}}, {"name": "ship", "arguments": {"street": {"name": "Main"}}}]')
    assert not _accepted(both, '[{"name": "post", "arguments": {"street": {"name": "Main"}}}]')
    optional = {"type": "object", "properties": {"street": {"anyOf": [{"$ref": "#/$defs/Street"}, {"type": "null"}]}},
                "$defs": address["$defs"]}  # pydantic's Optional[Street]: the same definition
    mixed = forced_schema("required", parse_tools([{"type": "function", "function": {"name": "ship", "parameters": address}},
                                                   {"type": "function", "function": {"name": "bill", "parameters": optional}}]), True)
    assert _accepted(mixed, '[{"name": "bill", "arguments": {"street": null}}]')
    same = forced_schema("required", parse_tools([{"type": "function", "function": {"name": n, "parameters": address}}
                                                  for n in ("ship", "bill", "post")]), True)
    assert list(same["$defs"]) == ["Street", "tool-0-parameters", "tool-1-parameters", "tool-2-parameters"]  # one copy
    calls = forced_calls('[{"name": "ship", "arguments": {"street": {"name": "Malmö"}}}]', "required")
    assert calls[0].arguments == '{"street": {"name": "Malmö"}}'  # the text as written, not \\u-escaped


def test_qwen3_coder_reads_a_parameter_left_unclosed_and_any_schema():
    text = "<tool_call>\n<function=book>\n<parameter=nights>\n3\n<parameter=city>\nOslo\n</function>\n</tool_call>"
    tools = parse_tools([{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"nights": {"type": "integer"}, "city": True}}}}])  # `true`: any value
    assert json.loads(parse_calls(text, "qwen3_coder", tools)[1][0].arguments) == {"nights": 3, "city": "Oslo"}


def test_a_mistral_answer_keeps_its_special_call_marker_in_the_text_for_the_parser():
    """Mistral's [TOOL_CALLS] is a special token: skipped from the text, no call would ever be found (vLLM keeps them
    for this parser too)."""
    from types import SimpleNamespace

    from app.api.serving import OpenAIServing

    tokenizer = SimpleNamespace(chat_template="{{ messages }}", encode=lambda text, **_: [1, 2],
                                apply_chat_template=lambda messages, **_: str(messages))
    serving = OpenAIServing(None, tokenizer, "m", 64, [0], 8, tool_parser="mistral")
    auto = serving._chat_plans(parse_body({**CHAT, "tools": [WEATHER]}, ChatCompletionRequest))[0]
    plain = serving._chat_plans(parse_body(CHAT, ChatCompletionRequest))[0]
    assert (auto.sampling.skip_special_tokens, plain.sampling.skip_special_tokens) == (False, True)


@pytest.mark.parametrize("arguments", ["[" * 3000 + "]" * 3000, "9" * 5000])  # past the parser's depth; 4,300+ digits
def test_json_python_cannot_read_is_no_call_in_an_answer_and_no_arguments_in_history(arguments):
    text = f'<tool_call>\n{{"arguments": {arguments}, "name": "get_weather"}}\n</tool_call>'  # read whole: keys reversed
    assert parse_calls(text, "hermes") == (text, [])
    history = [{"role": "assistant", "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]
    assert render_for_template(history, [])[0]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'


def test_allowed_tools_show_and_let_the_model_call_those_alone_in_their_mode():
    """OpenAI's ``tool_choice: {"type": "allowed_tools", ...}``: the model is shown, and may call, the allowed tools
    only ("required": one of them must be called); a name among no tools is a 400; the Responses API's flat form too."""
    from app.api.responses import chat_body

    def choice(mode: str, *names: str) -> dict:
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "function", "function": {"name": name}} for name in names]}}

    required = parse_body({**CHAT, "tools": [WEATHER, TIME], "tool_choice": choice("required", "get_time")}, ChatCompletionRequest)
    assert [t.name for t in required.parsed_tools()] == ["get_time"] and required.tool_choice_resolved() == "required"
    grammar = required.sampling_params(8).grammar
    assert "get_time" in grammar and "get_weather" not in grammar
    twice = parse_body({**CHAT, "tools": [WEATHER, TIME], "tool_choice": choice("auto", "get_time", "get_time")}, ChatCompletionRequest)
    assert [t.name for t in twice.parsed_tools()] == ["get_time"]  # each once
    auto = parse_body({**CHAT, "tools": [WEATHER, TIME], "tool_choice": choice("auto", "get_weather")}, ChatCompletionRequest)
    assert [t.name for t in auto.parsed_tools()] == ["get_weather"] and auto.tool_choice_resolved() == "auto"
    for bad, param in ((choice("auto", "get_news"), "tool_choice.allowed_tools.tools[0]"),
                       (choice("sometimes", "get_time"), "tool_choice.allowed_tools")):
        with pytest.raises(APIError) as info:
            parse_body({**CHAT, "tools": [WEATHER, TIME], "tool_choice": bad}, ChatCompletionRequest)
        assert info.value.param == param
    flat = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    body = chat_body({"model": "m", "input": "What time is it?", "tool_choice": flat,
                      "tools": [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]})
    assert [t.name for t in parse_body(body, ChatCompletionRequest).parsed_tools()] == ["get_time"]


@pytest.mark.parametrize("parameters, says", [
    ({"type": "object", "$defs": 5}, "$defs must be an object"),
    ({"type": "object", "properties": {"a": {}}, "required": True}, '"required" must be a list'),
])
def test_a_tools_schema_keyword_no_schema_has_is_a_400_not_a_500(parameters, says):
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    with pytest.raises(APIError) as refused:
        forced_schema("required", tools, True)
    assert refused.value.status == 400 and says in refused.value.message


def test_a_formats_x_guidance_that_is_no_object_is_a_400_beside_tools():
    from app.api.structured import json_in_lark

    with pytest.raises(APIError) as refused:
        json_in_lark(json.dumps({"type": "object", "x-guidance": 5}))
    assert refused.value.status == 400 and "x-guidance" in refused.value.message
