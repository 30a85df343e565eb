import json

import pytest

from app.api.errors import APIError, to_api_error
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.api.token_requests import GenerateRequest
from app.engine import EngineOverloadedError


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{bad", 400, None),
        (b"[]", 400, None),
        ({"model": "m"}, 400, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ({"model": "m", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "m", "prompt": "x", "n": 129}, 400, "n"),
        ({"model": "m", "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
        ({"model": "m", "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo: nothing to answer
        ({"model": "m", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"model": "m", "prompt": 5}, 400, "prompt"),  # the field, not the union member pydantic tried ("prompt.str")
        ({"model": "m", "prompt": "x", "ignore_eos": True, "structured_outputs": {"json": "{not json"}}, 400,
         "structured_outputs.json"),
    ],
)
def test_bad_completion_bodies(body, status, param):
    with pytest.raises(APIError) as info:
        parse_body(body, CompletionRequest)
    assert info.value.status == status
    assert info.value.param == param
    assert info.value.to_dict()["error"]["message"]


def test_null_is_unset_as_openai_s_nullable_fields_are():
    nulls = {"n": None, "stream": None, "echo": None, "min_tokens": None, "ignore_eos": None, "skip_special_tokens": None,
             "logprobs": None, "stream_options": None, "best_of": None, "stop": None}
    completion = parse_body(json.dumps({"prompt": "x", "max_tokens": 4, **nulls}), CompletionRequest)
    assert completion == parse_body(json.dumps({"prompt": "x", "max_tokens": 4}), CompletionRequest)
    chat = parse_body(json.dumps({**CHAT, "logprobs": None, "n": None, "stream": True, "stream_options": {"include_usage": None}}),
                      ChatCompletionRequest)
    assert (chat.logprobs, chat.n, chat.include_usage) == (False, 1, False)
    # a field whose null means something keeps it: max_tokens null is as many as the context leaves
    assert parse_body(json.dumps({"prompt": "x", "max_tokens": None}), CompletionRequest).max_tokens is None
    with pytest.raises(APIError) as info:  # a required field is still required
        parse_body(json.dumps({"prompt": None}), CompletionRequest)
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_an_earlier_tool_call_without_its_arguments_has_none_and_one_without_its_name_is_a_400():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": None, "tool_calls": [call]}]}), ChatCompletionRequest)
    assert chat.messages[1].as_template_message()["tool_calls"][0]["function"]["arguments"] == "{}"  # as vLLM: the chat goes on
    chat.messages[1].tool_calls[0]["function"] = {"arguments": "{}"}
    with pytest.raises(APIError) as info:
        chat.messages[1].as_template_message()
    assert (info.value.status, info.value.param) == (400, "messages.tool_calls[0]") and "function.name" in info.value.message


def test_chat_needs_messages():
    with pytest.raises(APIError, match="messages"):
        parse_body({"model": "m", "messages": []}, ChatCompletionRequest)


def test_defaults_fill_unset_fields_only():
    request = parse_body({"prompt": "x", "top_p": 0.5}, CompletionRequest)
    params = request.sampling_params(8, {"temperature": 0.2, "top_p": 0.9})
    assert params.temperature == 0.2 and params.top_p == 0.5


def test_error_mapping_unwraps_causes():
    class Wrapped(Exception):
        def __init__(self, cause):
            self.cause = cause

    assert to_api_error(Wrapped(APIError(404, "gone"))).status == 404
    assert to_api_error(EngineOverloadedError("full")).status == 503
    assert to_api_error(ValueError("bad")).status == 500  # an unexpected ValueError is ours (tests/unit/test_errors.py)


def test_sampling_combinations_the_fields_cannot_check_are_400s():
    request = parse_body({"prompt": "x", "min_tokens": 10, "max_tokens": 5}, CompletionRequest)
    with pytest.raises(APIError, match="min_tokens") as info:
        request.sampling_params(request.max_tokens)
    assert info.value.status == 400


def test_logprobs_requests_map_to_sampling():
    completion = parse_body({"prompt": "x", "logprobs": 3}, CompletionRequest)
    assert completion.sampling_params(4).logprobs == 3
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_body({**chat, "logprobs": True, "top_logprobs": 2}, ChatCompletionRequest).sampling_params(4).logprobs == 2
    assert parse_body({**chat, "logprobs": True}, ChatCompletionRequest).sampling_params(4).logprobs == 0
    assert parse_body(chat, ChatCompletionRequest).sampling_params(4).logprobs is None
    with pytest.raises(APIError, match="top_logprobs requires logprobs"):
        parse_body({**chat, "top_logprobs": 2}, ChatCompletionRequest)


def test_prompt_logprobs_map_to_sampling_the_wider_of_echos_and_theirs_and_are_not_streamed():
    def prompt_count(body: dict, cls=CompletionRequest) -> int | None:
        return parse_body(body, cls).sampling_params(4).prompt_logprobs

    assert prompt_count({"prompt": "x", "prompt_logprobs": 2}) == 2
    assert prompt_count({"prompt": "x", "prompt_logprobs": 2, "echo": True, "logprobs": 5}) == 5
    assert prompt_count({"prompt": "x", "prompt_logprobs": 7, "echo": True, "logprobs": 5}) == 7
    assert prompt_count({"prompt": "x", "logprobs": 5}) is None
    assert prompt_count({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}, ChatCompletionRequest) == 0
    for body in ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, {"prompt": "x", "prompt_logprobs": 21}):
        with pytest.raises(APIError) as info:
            parse_body(body, CompletionRequest)
        assert info.value.param == "prompt_logprobs"


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
WRONG_TYPES = [
    (CompletionRequest, {"prompt": "x", "stream": "true"}, "stream"),
    (CompletionRequest, {"prompt": "x", "stream": 1}, "stream"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "temperature": "0.5"}, "temperature"),
    (CompletionRequest, {"prompt": "x", "logprobs": "2"}, "logprobs"),
    (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs"),
    (CompletionRequest, {"prompt": "x", "seed": "7"}, "seed"),
    (CompletionRequest, {"prompt": "x", "seed": True}, "seed"),
    (CompletionRequest, {"prompt": "x", "n": "1"}, "n"),
    (CompletionRequest, {"prompt": "x", "n": True}, "n"),  # lax mode read this as n=1 and answered
    (CompletionRequest, {"prompt": "x", "ignore_eos": "false"}, "ignore_eos"),
    (ChatCompletionRequest, {**CHAT, "logprobs": "true"}, "logprobs"),
    (ChatCompletionRequest, {**CHAT, "logprobs": 1}, "logprobs"),
    (ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    (ChatCompletionRequest, {**CHAT, "max_completion_tokens": "9"}, "max_completion_tokens"),
    (ChatCompletionRequest, {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (GenerateRequest, {"prompt": "x", "max_new_tokens": "5"}, "max_new_tokens"),
]


@pytest.mark.parametrize("request_cls, body, param", WRONG_TYPES, ids=[f"{b[2]}={list(b[1].values())[-1]!r}" for b in WRONG_TYPES])
def test_a_value_of_the_wrong_json_type_is_a_400_not_coerced(request_cls, body, param):
    with pytest.raises(APIError) as info:
        parse_body(json.dumps(body), request_cls)  # as the HTTP edge receives it
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "invalid_type")
    assert info.value.message.startswith(f"Invalid type for {param}: ")


def test_an_integer_is_a_number_as_openai_accepts_it():
    body = {"prompt": "x", "temperature": 1, "top_p": 1, "presence_penalty": 0, "max_tokens": 5, "seed": 3, "logprobs": 2}
    request = parse_body(json.dumps(body), CompletionRequest)
    params = request.sampling_params(request.max_tokens)
    assert (params.temperature, params.top_p, params.presence_penalty) == (1.0, 1.0, 0.0)
    assert isinstance(params.temperature, float)
    assert (params.max_tokens, params.seed, params.logprobs) == (5, 3, 2)


def test_values_of_the_right_type_still_parse():
    chat = parse_body(json.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": False,
                                  "stop": ["\n"], "logit_bias": None, "n": 1}), ChatCompletionRequest)
    assert chat.stream and chat.include_usage and chat.messages[0].text() == "hi"
    completion = parse_body(json.dumps({"prompt": [1, 2, 3], "echo": False, "ignore_eos": True}), CompletionRequest)
    assert completion.prompt == [1, 2, 3] and completion.ignore_eos
    generate = parse_body(json.dumps({"prompt": "x", "max_new_tokens": 3, "temperature": 0}), GenerateRequest)
    assert generate.to_completion().max_tokens == 3 and generate.to_completion().temperature == 0.0


def test_fields_that_change_nothing_in_generation_are_accepted():
    ignored = {"user": "u-1", "store": False, "metadata": {"team": "search"}, "service_tier": "auto",
               "safety_identifier": "u-1", "prompt_cache_key": "session-7", "prompt_cache_retention": "24h",
               "prompt_cache_options": {}}
    chat = parse_body(json.dumps({**CHAT, **ignored, "parallel_tool_calls": True}), ChatCompletionRequest)
    assert chat.sampling_params(4) == parse_body(json.dumps(CHAT), ChatCompletionRequest).sampling_params(4)
    parse_body(json.dumps({"prompt": "x", **ignored}), CompletionRequest)
    # an OpenAI-shaped assistant message replayed as history, and a stream option at its no-op value
    replayed = [*CHAT["messages"], {"role": "assistant", "content": "Paris.", "refusal": None}, {"role": "user", "content": "Why?"}]
    chat = parse_body(json.dumps({**CHAT, "messages": replayed, "stream": True,
                                  "stream_options": {"include_usage": True, "include_obfuscation": False}}), ChatCompletionRequest)
    assert chat.include_usage and chat.messages[1].as_template_message() == {"role": "assistant", "content": "Paris."}
    with pytest.raises(APIError, match="each tool must be"):  # a tool without a function is a 400 naming the tool
        parse_body(json.dumps({**CHAT, "tools": [{"type": "function"}], "parallel_tool_calls": True}), ChatCompletionRequest)
    tool = {"type": "function", "function": {"name": "f", "defer_loading": False}, "defer_loading": False}  # OpenAI's default
    assert [t.name for t in parse_body({**CHAT, "tools": [tool]}, ChatCompletionRequest).parsed_tools()] == ["f"]
    for deferred in ({**tool, "defer_loading": True}, {**tool, "function": {"name": "f", "defer_loading": True}}):
        with pytest.raises(APIError, match="defer_loading is not supported"):  # a tool the model would not be shown
            parse_body({**CHAT, "tools": [deferred]}, ChatCompletionRequest).parsed_tools()


@pytest.mark.parametrize("field, value", [("seed", 2**64 + 5), ("seed", -(2**63) - 1), ("top_k", 2**63),
                                          ("min_tokens", 2**63), ("max_tokens", 2**63), ("repetition_penalty", 101),
                                          ("repetition_penalty", 1e-38), ("truncate_prompt_tokens", 0)])
def test_numbers_past_what_openai_and_vllm_take_are_a_400_naming_the_field(field, value):
    with pytest.raises(APIError) as info:
        parse_body(json.dumps({"prompt": "x", field: value}), CompletionRequest)
    assert (info.value.status, info.value.param) == (400, field)


def test_logit_bias_keys_must_be_token_ids():
    request = parse_body(json.dumps({"prompt": "x", "logit_bias": {"42": -100, "7": 5.5}}), CompletionRequest)
    assert request.sampling_params(4).logit_bias == ((7, 5.5), (42, -100.0))
    for key in ("hello", "٥", "1_0", " 5 "):  # int() would read an Arabic-Indic five, "1_0" and " 5 " as numbers
        with pytest.raises(APIError) as info:
            parse_body(json.dumps({"prompt": "x", "logit_bias": {key: 1}}), CompletionRequest).sampling_params(4)
        assert (info.value.status, info.value.param) == (400, "logit_bias")
    with pytest.raises(APIError) as info:
        parse_body(json.dumps({"prompt": "x", "logit_bias": {"3": 200}}), CompletionRequest).sampling_params(4)
    assert (info.value.status, info.value.param) == (400, "logit_bias") and "token 3" in info.value.message


@pytest.mark.parametrize("biases, says", [
    ({"97": 1, "097": 2}, "names token 97 twice"),  # one bias would silently replace the other
    ({"99999999999999999999999": 1}, "is not a token id"),  # the key is wrong, not its bias
    ({"-3": 1}, "is not a token id"),
])
def test_a_logit_bias_key_that_is_no_single_token_id_is_a_400_saying_so(biases, says):
    with pytest.raises(APIError) as info:
        parse_body(json.dumps({"prompt": "x", "logit_bias": biases}), CompletionRequest).sampling_params(4)
    assert (info.value.status, info.value.param) == (400, "logit_bias") and says in info.value.message


@pytest.mark.parametrize("raw, param, code", [
    ('{"prompt": "a\\ud800b"}', "prompt", "invalid_text"),  # JSON's escape of a lone surrogate: no text to tokenize
    ('{"prompt": ["x", "\\udfff"]}', "prompt.1", "invalid_text"),
    ('{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages.0.content", "invalid_text"),
    ('{"prompt": [[1, 2], [3, "\\ud800"]]}', "prompt.1.1", "invalid_text"),  # not only token ids: looked into
    ('{"prompt": "x", "metadata": ' + "[" * 70 + "1" + "]" * 70 + "}", None, "invalid_json"),  # lists past 64 levels
    ('{"prompt": "x", "metadata": ' + "[" * 63 + "[1, 2]" + "]" * 63 + "}", "metadata" + ".0" * 63 + ".0", "invalid_json"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", None, "invalid_json"),  # past Python's 4,300 digits
    ('{"prompt": "x", "metadata": ' + "[" * 3000 + "]" * 3000 + "}", None, "invalid_json"),  # past the parser's depth
    ('{"prompt": "x", "structured_outputs": {"json": ' + '{"items": ' * 70 + "{}" + "}" * 70 + "}}", None, "invalid_json"),
    ('{"prompt": "x", "temperature": NaN}', None, "invalid_json"),  # Python's json reads it; JSON has no NaN
    ('{"prompt": "x", "metadata": {"a": -Infinity}}', None, "invalid_json"),
])
def test_bodies_no_tokenizer_or_serializer_could_take_are_400s(raw, param, code):
    request_cls = ChatCompletionRequest if "messages" in raw else CompletionRequest
    with pytest.raises(APIError) as info:
        parse_body(raw, request_cls)
    assert info.value.status == 400 and info.value.code == code
    assert param is None or info.value.param == param
    assert parse_body('{"prompt": "an emoji \\ud83d\\ude00 is a surrogate pair"}', CompletionRequest).prompt.endswith("pair")


def test_a_handle_calls_dict_with_integer_keys_is_a_400_naming_the_field():
    """A Python caller's body reaches the checks as a dict, whose keys need not be strings (``logit_bias: {50256:
    -100}``): the field's type check answers, not the text check (a 500)."""
    with pytest.raises(APIError) as info:
        parse_body({"prompt": "x", "logit_bias": {50256: -100}}, CompletionRequest)
    assert info.value.status == 400 and info.value.param.startswith("logit_bias")


def test_stream_options_unstreamed_are_a_400_unless_empty_as_vllm_takes_them():
    assert parse_body({"prompt": "x", "stream_options": {}}, CompletionRequest).include_usage is False
    with pytest.raises(APIError) as info:
        parse_body({"prompt": "x", "stream_options": {"include_usage": False}}, CompletionRequest)
    assert info.value.param == "stream_options"


def test_more_prompts_than_a_request_may_generate_are_a_400_before_each_is_validated():
    for prompts in (["x"] * 4097, [[1, 2]] * 200_000):
        with pytest.raises(APIError) as info:
            parse_body(json.dumps({"prompt": prompts}), CompletionRequest)
        assert (info.value.status, info.value.param) == (400, "prompt")
        assert info.value.message.startswith(f"{len(prompts)} prompts is more than 4096")
    with pytest.raises(APIError) as info:
        parse_body({"prompt": ["x"] * 1024, "n": 8}, CompletionRequest)
    assert info.value.message.startswith("1024 prompts x 8 choices is more than 4096")
    assert len(parse_body({"prompt": ["x"] * 4096}, CompletionRequest).prompt) == 4096  # the replica's bound decides


def test_an_openai_answer_replayed_as_history_is_accepted_and_names_reach_the_template():
    """The `openai` client's ``message.model_dump()`` carries annotations, audio and function_call (null): accepted,
    not shown to the model; a message's ``name`` goes to the template, as vLLM passes it."""
    answer = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None, "function_call": None}
    chat = parse_body({"messages": [{"role": "user", "content": "Capital?", "name": "ada"}, answer]}, ChatCompletionRequest)
    assert [m.as_template_message() for m in chat.messages] == [{"role": "user", "content": "Capital?", "name": "ada"},
                                                                {"role": "assistant", "content": "Paris."}]
    legacy = parse_body({"messages": [{**answer, "function_call": {"name": "f", "arguments": "{}"}}]}, ChatCompletionRequest)
    [call] = legacy.messages[0].as_template_message()["tool_calls"]  # the deprecated form: read as its one tool call
    assert call["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize("field, unset, asked", [
    ("audio", None, {"voice": "alloy", "format": "wav"}), ("modalities", ["text"], ["text", "audio"]),
    ("prediction", None, {"type": "content", "content": "x"}),
    ("verbosity", None, "low"), ("verbosity", "medium", "high"), ("web_search_options", None, {}),
])
def test_openai_features_not_served_are_taken_unset_and_refused_when_asked(field, unset, asked):
    parse_body({**CHAT, field: unset}, ChatCompletionRequest)
    with pytest.raises(APIError) as info:
        parse_body({**CHAT, field: asked}, ChatCompletionRequest)
    assert (info.value.status, info.value.param) == (400, field) and "not supported" in str(info.value)


@pytest.mark.parametrize("text", ["[" * 3000, "9" * 5000])  # past the parser's depth; past Python's 4,300 digits
def test_json_inside_a_json_string_that_python_cannot_read_is_a_400_naming_the_field(text):
    with pytest.raises(APIError) as info:
        parse_body(json.dumps({"prompt": "x", "structured_outputs": {"json": text}}), CompletionRequest).grammar()
    assert (info.value.status, info.value.param) == (400, "structured_outputs.json")


@pytest.mark.parametrize("body, param, names", [
    ({"prompt": [1, "a"]}, "prompt", "a list of token ids"),  # pydantic's first error is the string member's alone
    ({"prompt": [[97], "a"]}, "prompt", "a list of token ids"),
    ({"prompt": None}, "prompt", "a list of token ids"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "a list of content parts"),
])
def test_a_field_of_several_shapes_given_none_of_them_is_a_400_naming_every_shape(body, param, names):
    with pytest.raises(APIError) as info:
        parse_body(body, ChatCompletionRequest if "messages" in body else CompletionRequest)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "invalid_type")
    assert names in info.value.message and "a string" in info.value.message
