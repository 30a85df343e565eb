"""A reasoning model's thinking apart from its answer (``model.reasoning_parser``): the splitter on its own, then the
real serving layer over the fake model replaying recorded answers: the message's ``reasoning`` and ``content``,
streamed or not, calls read from the content, and what is left whole (a grammar's output, a response's text)."""

import json

import pytest

from app.api import response_stream
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.reasoning import ReasoningSplitter, split, starts_inside
from app.api.responses import parse_request
from app.config import AppConfig
from tests.serve import fake_model
from tests.serve.fake_model import REPLAY

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("text, inside, expected", [
    ("<think>Let me see.</think>Paris.", False, ("Let me see.", "Paris.")),  # Qwen3: the output opens its block
    ("\n<think>Let me see.</think>\n\nParis.", False, ("Let me see.", "\n\nParis.")),
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),  # DeepSeek-R1: the prompt opened it
    ("Paris.", False, (None, "Paris.")),  # thinking off (an empty block in the prompt): all content
    ("Let me see, and", True, ("Let me see, and", None)),  # cut short while thinking
    ("a </thin", True, ("a </thin", None)),  # a marker's start that never became one
    ("<think>Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),  # opened again after the prompt's: dropped
    ("Paris. <think>x</think>", False, (None, "Paris. <think>x</think>")),  # a block later in the answer: content
])
def test_an_answer_splits_alike_whole_and_fed_in_any_pieces(text, inside, expected):
    assert split(text, inside) == expected
    for size in (1, 2, 3, 5):
        splitter, thought, content = ReasoningSplitter(inside), "", ""
        for piece in [text[i:i + size] for i in range(0, len(text), size)] + [None]:
            r, c = splitter.finish() if piece is None else splitter.feed(piece)
            thought, content = thought + r, content + c
        assert (thought if expected[0] is not None else None, content or None) == (expected[0], expected[1] or None), size


@pytest.mark.parametrize("parser, tail, inside", [
    ("qwen3", "<|im_start|>assistant\n", False), ("qwen3", "<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", False),  # Qwen3's enable_thinking: false
    ("qwen3", "assistant\n<think>\nLet me", True),  # a continued assistant turn, inside its block
    ("deepseek_r1", "<｜Assistant｜>", True),  # R1's answer thinks first, as vLLM reads it
    ("deepseek_r1", "<｜Assistant｜><think>\n", True), ("deepseek_r1", "<think>\n\n</think>\n\n", False),
])
def test_where_the_answer_starts_follows_the_prompts_last_block(parser, tail, inside):
    assert starts_inside(parser, tail) is inside
    assert starts_inside(parser, tail, continued=True) is (tail.rfind("<think>") > tail.rfind("</think>"))


@pytest.fixture
def server(quick_fake_steps):
    served = {"model": {"source": "fake-tools", "reasoning_parser": "qwen3"}, "engine": {"separate_process": False}}
    server = fake_model.fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    yield server
    server.shutdown(timeout_s=1)


def _body(answer: str, **extra) -> dict:
    content = f"Weather in Oslo? {REPLAY[0].decode()}{answer}{REPLAY[1].decode()}"  # the fake model answers this
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 400, **extra}


async def _whole_and_streamed(server, body: dict) -> tuple[dict, list[dict]]:
    whole = (await server.serving.chat(parse_body(body, ChatCompletionRequest)))["choices"][0]
    chunks = [c async for c in server.serving.chat_stream(parse_body({**body, "stream": True}, ChatCompletionRequest))]
    return whole, [c["choices"][0] for c in chunks if c["choices"]]


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d["delta"].get(key) or "" for d in deltas)


async def test_the_thinking_is_the_messages_reasoning_streamed_or_not(server):
    whole, deltas = await _whole_and_streamed(server, _body("<think>Rain, probably.</think>It rains in Oslo."))
    message = whole["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("Rain, probably.",) * 2 + ("It rains in Oslo.",)
    assert _joined(deltas, "reasoning") == _joined(deltas, "reasoning_content") == "Rain, probably."
    assert _joined(deltas, "content") == "It rains in Oslo." and "<" not in _joined(deltas, "content")
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "stop"
    answer = await server.serving.chat(parse_body(_body("<think>Rain, probably.</think>It rains in Oslo."), ChatCompletionRequest))
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": len("Rain, probably.")}  # a byte a token
    plain = await server.serving.chat(parse_body(_body("It rains."), ChatCompletionRequest))
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


async def test_a_prompt_that_opens_the_block_starts_the_answer_thinking(server):
    """DeepSeek-R1's template ends the prompt with <think> (here: an assistant turn continued from it)."""
    body = _body("Rain, probably.</think>It rains.")
    body["messages"].append({"role": "assistant", "content": "<think>"})
    whole, deltas = await _whole_and_streamed(server, {**body, "continue_final_message": True})
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("Rain, probably.", "It rains.")
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content")) == ("Rain, probably.", "It rains.")


async def test_the_start_is_read_from_the_turn_the_answer_follows_not_from_the_users_words(server):
    """A user quoting the markers starts no thinking; a long continued assistant turn that opened a block (past any
    fixed window of the prompt's end) goes on thinking."""
    quoted = _body("Ok.")
    quoted["messages"][0]["content"] = "Explain <think>. " + quoted["messages"][0]["content"]
    whole = (await server.serving.chat(parse_body(quoted, ChatCompletionRequest)))["choices"][0]
    assert whole["message"]["content"] == "Ok." and "reasoning" not in whole["message"]
    body = _body("more.</think>Answer.")
    body["messages"].append({"role": "assistant", "content": "<think>" + "so far " * 20})
    continued, deltas = await _whole_and_streamed(server, {**body, "continue_final_message": True})
    assert (continued["message"]["reasoning"], continued["message"]["content"]) == ("more.", "Answer.")
    assert (_joined(deltas, "reasoning"), _joined(deltas, "content")) == ("more.", "Answer.")


async def test_calls_are_read_from_the_content_after_the_thinking(server):
    answer = '<think>I need the weather.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    whole, deltas = await _whole_and_streamed(server, _body(answer, tools=[WEATHER]))
    assert whole["message"]["reasoning"] == _joined(deltas, "reasoning") == "I need the weather."
    [call] = whole["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"city": "Oslo"}' and not whole["message"]["content"]
    entries = [entry for d in deltas for entry in d["delta"].get("tool_calls", [])]
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Oslo"}'
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"


async def test_beside_strict_tools_the_text_still_thinks_and_every_tokens_logprob_goes_out_once(server):
    """A strict tool's grammar under auto leaves the text free (app/api/tools.py strict_calls): the thinking is still
    split; each token's logprob goes out once, the thinking's with the thinking."""
    answer = "<think>Rain.</think>It rains."
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    whole, deltas = await _whole_and_streamed(server, _body(answer, tools=[strict], logprobs=True))
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("Rain.", "It rains.")
    thinking = [d for d in deltas if d["delta"].get("reasoning")]
    assert thinking and all(d["logprobs"] for d in thinking)
    streamed = sum(len((d["logprobs"] or {}).get("content") or []) for d in deltas)
    assert streamed == len(whole["logprobs"]["content"]) == len(answer.encode())


async def test_include_reasoning_false_leaves_the_thinking_out(server, tools_server):
    whole, deltas = await _whole_and_streamed(server, _body("<think>Rain.</think>It rains.", include_reasoning=False))
    assert whole["message"] == {"role": "assistant", "content": "It rains."}
    assert not any("reasoning" in d["delta"] for d in deltas) and _joined(deltas, "content") == "It rains."
    for serving, extra in ((server.serving, {"logprobs": True}), (tools_server.serving, {})):  # no parser: no way to
        with pytest.raises(APIError) as caught:
            await serving.chat(parse_body(_body("x", include_reasoning=False, **extra), ChatCompletionRequest))
        assert caught.value.param == "include_reasoning"


@pytest.mark.parametrize("answer, extra", [
    ('<think>Cold.</think>\n\n{"a": 1}', {"response_format": {"type": "json_object"}}),
    ('<think>Cold.</think>\n{"city": "Oslo"}', {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ('<think>Cold.</think>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', {"tools": [WEATHER], "tool_choice": "required"}),
])
async def test_a_format_or_a_forced_call_comes_after_the_thinking_streamed_or_not(server, answer, extra):
    """The grammar holds the answer after the thinking (app/api/reasoning.py after_thinking; on a real tokenizer in
    tests/model/test_reasoned_formats.py): the thinking is the reasoning, the format's text the content or the call."""
    whole, deltas = await _whole_and_streamed(server, _body(answer, **extra))
    assert whole["message"]["reasoning"] == _joined(deltas, "reasoning") == "Cold."
    if "tools" in extra:
        [call] = whole["message"]["tool_calls"]
        entries = [entry for d in deltas for entry in d["delta"].get("tool_calls", [])]
        assert call["function"]["arguments"] == "".join(e["function"]["arguments"] for e in entries) == '{"city": "Oslo"}'
    else:
        assert whole["message"]["content"] == _joined(deltas, "content") == '\n\n{"a": 1}'


async def test_a_responses_thinking_is_a_reasoning_item_before_its_message_streamed_or_not(server):
    """As OpenAI's reasoning models answer: a ``reasoning`` item (its text as ``reasoning_text``, streamed as
    ``response.reasoning_text.delta``s), then the message; each validates as the openai SDK's own models."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "m", "input": _body("<think>Rain, probably.</think>It rains.")["messages"][0]["content"]}
    whole_body, request = parse_request(json.dumps(body).encode())
    whole = await response_stream.whole_response(whole_body, server.serving.chat_stream(request), "resp_1", 0)
    stream_body, streamed = parse_request(json.dumps({**body, "stream": True}).encode())
    events = [e async for e in response_stream.response_events(stream_body, server.serving.chat_stream(streamed), "resp_2", 0)]
    Response.model_validate(whole, strict=True)
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event, strict=True)
    thought, message = whole["output"]
    assert (thought["type"], thought["content"][0]["text"], thought["status"]) == ("reasoning", "Rain, probably.", "completed")
    assert message["type"] == "message" and message["content"][0]["text"] == "It rains."
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Rain, probably.")
    with_logprobs = {**body, "include": ["message.output_text.logprobs"]}
    logged_body, logged = parse_request(json.dumps(with_logprobs).encode())
    logged_whole = await response_stream.whole_response(logged_body, server.serving.chat_stream(logged), "resp_3", 0)
    tokens = [entry["token"] for entry in logged_whole["output"][1]["content"][0]["logprobs"]]
    assert "".join(tokens) == "It rains."  # the message's own tokens, none of the thinking's markers
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "Rain, probably." and events[-1]["response"]["output"][0]["content"] == thought["content"]
    done = [e["type"] for e in events].index("response.reasoning_text.done")
    assert done < [e["type"] for e in events].index("response.output_text.delta")  # the item is done before the answer


def test_an_unknown_parser_is_refused_at_load():
    with pytest.raises(ValueError, match="reasoning_parser"):
        AppConfig.from_dict({"models": [{"model": {"source": "fake-tools", "reasoning_parser": "o1"}}]})


def test_thinking_tokens_count_up_to_the_end_marker_where_it_is_one_token():
    class OneTokenMarkers:  # </think> as one token, as Qwen3's and DeepSeek-R1's tokenizers have it
        pieces = {1: "Rain", 2: ".", 9: "</think>", 3: "It rains.", 7: "<tool_call>{}</tool_call>"}

        def encode(self, text, add_special_tokens=False):
            return [9] if text == "</think>" else [1] * len(text)  # a character a token otherwise

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    from app.api.reasoning import thinking_tokens

    assert thinking_tokens([1, 2, 9, 3], True, OneTokenMarkers()) == 3  # its thinking and the marker
    assert thinking_tokens([1, 2], True, OneTokenMarkers()) == 2  # cut short while thinking: all of it
    assert thinking_tokens([3], False, OneTokenMarkers()) == 0  # it did not think
    # Qwen3's call while thinking ended it: the thinking's own tokens, not up to the block's late </think>
    assert thinking_tokens([1, 2, 7, 9, 3], True, OneTokenMarkers(), "<tool_call>") == len("Rain.")


@pytest.mark.parametrize("special", [True, False])
def test_a_marker_the_tokenizer_calls_special_is_found_by_decoding_it(special):
    """Qwen3's and DeepSeek-R1's tokenizers have ``</think>`` as one added token, special or not: where it is special,
    ``skip_special_tokens`` would leave it out of the text, so the parser's requests keep special tokens."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from app.api.reasoning import is_special

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                                        unk_token="[UNK]")
    tokenizer.add_tokens([AddedToken("<think>", special=special), AddedToken("</think>", special=special)], special_tokens=special)
    assert is_special(tokenizer) is special
    ids = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(ids) == 1 and (tokenizer.decode(ids, skip_special_tokens=True) == "") is special
    from app.api.serving import OpenAIServing

    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    serving = OpenAIServing(None, tokenizer, "m", 64, [0], len(tokenizer), reasoning_parser="qwen3")
    [plan] = serving._chat_plans(parse_body({"messages": [{"role": "user", "content": "a"}]}, ChatCompletionRequest))
    assert plan.reasoning_inside is False and plan.sampling.skip_special_tokens is not special


def test_a_call_marker_ends_the_thinking_where_it_is_given_alike_whole_and_in_pieces():
    text = 'I need it. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    expected = ("I need it. ", '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert split(text, True, "<tool_call>") == expected and split(text, True) == (text, None)
    assert split("a</think>b <tool_call>", True, "<tool_call>") == ("a", "b <tool_call>")  # after the thinking: content
    closed_late = text + "</think>\n\nDone."  # the block the call ended closes after it: that marker is no content
    assert split(closed_late, True, "<tool_call>") == (expected[0], expected[1] + "\n\nDone.")
    for size in (1, 2, 3, 5):
        splitter, thought, content = ReasoningSplitter(True, "<tool_call>"), "", ""
        for piece in [closed_late[i:i + size] for i in range(0, len(closed_late), size)] + [None]:
            r, c = splitter.finish() if piece is None else splitter.feed(piece)
            thought, content = thought + r, content + c
        assert (thought, content) == (expected[0], expected[1] + "\n\nDone."), size


async def test_a_qwen3_call_written_while_thinking_ends_the_thinking_and_is_the_call(server):
    """As vLLM's qwen3 parser reads it: the call is made, the thinking before it the reasoning. Without tools, or where a
    strict tool's grammar holds the calls (its thinking ends at </think> alone), the marker stays in the thinking."""
    answer = '<think>I need the weather. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    whole, deltas = await _whole_and_streamed(server, _body(answer, tools=[WEATHER]))
    assert whole["message"]["reasoning"] == _joined(deltas, "reasoning") == "I need the weather. "
    [call] = whole["message"]["tool_calls"]
    entries = [entry for d in deltas for entry in d["delta"].get("tool_calls", [])]
    assert call["function"]["arguments"] == "".join(e["function"]["arguments"] for e in entries) == '{"city": "Oslo"}'
    assert whole["finish_reason"] == deltas[-1]["finish_reason"] == "tool_calls"
    plain = await server.serving.chat(parse_body(_body(answer), ChatCompletionRequest))
    assert "<tool_call>" in plain["choices"][0]["message"]["reasoning"]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    held = await server.serving.chat(parse_body(_body(answer, tools=[strict]), ChatCompletionRequest))
    assert "<tool_call>" in held["choices"][0]["message"]["reasoning"] and "tool_calls" not in held["choices"][0]["message"]


THINKING = "<think>" + "Rain in Oslo, I should look it up. " * 3 + "</think>"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("tool_choice, answer", [("auto", CALL), ({"type": "function", "function": {"name": "get_weather"}},
                                                                  '{"city": "Oslo"}'), ("required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')])
async def test_thinking_not_shown_beside_tools_still_streams_a_chunk_per_token(server, tool_choice, answer):
    """A stream sends a chunk for each token, an empty one where its text is held: a hidden thinking (or a call's
    start held back) must not hold the stream's first byte until the answer, or a proxy's idle timeout cuts it."""
    body = _body(THINKING + answer, include_reasoning=False, tools=[TOOL], tool_choice=tool_choice)
    whole, deltas = await _whole_and_streamed(server, body)
    before_call = next(i for i, d in enumerate(deltas) if d["delta"].get("tool_calls"))
    assert before_call > len(THINKING)  # the opening chunk, then one a token (a byte a token here) while it thinks
    assert not any(d["delta"].get("reasoning") or d["delta"].get("content") for d in deltas[:before_call])
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


# Qwen3's shape: a thinking template whose turn opens the block, and one that writes an empty block (thinking off)
_QWEN3_OPENING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{OPENING}{% else %}<|endoftext|>{% endif %}")  # Phi's EOS


def _prompts(template: str):
    """The serving layer's prompts over a one-token tokenizer rendering ``template``: the text is what is tested."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from app.api.prompts import Prompts

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                        unk_token="[UNK]")
    tokenizer.chat_template = template
    return Prompts(tokenizer, "m", 4096, 1)


@pytest.mark.parametrize("parser, opening, inside", [
    ("qwen3", "<think>\n", True), ("deepseek_r1", "<think>\n\n</think>\n\n", False), ("deepseek_r1", "", True)])
@pytest.mark.parametrize("words", ["hi", "think", "Hello", "<think>", "</think>"])
def test_the_start_is_read_from_the_template_s_opening_of_the_turn_whatever_the_user_wrote(parser, opening, inside, words):
    """The user's words may be found inside the turn's opening ("hi" in "<think>"), or be a marker themselves."""
    from app.api.reasoning import answer_starts_inside

    prompts = _prompts(_QWEN3_OPENING.replace("{OPENING}", opening))
    request = parse_body({"messages": [{"role": "user", "content": words}]}, ChatCompletionRequest)
    text = prompts.chat_text(request)
    assert answer_starts_inside(parser, request, lambda: prompts.turn_opening(request, text)) is inside


def test_an_opening_that_follows_the_last_message_at_once_is_read_whole():
    """``<think>`` right after the message, where the render without it writes ``</s>``: the two share a "<", and the
    opening is still the marker, not "think>"."""
    from app.api.reasoning import answer_starts_inside

    prompts = _prompts("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}<think>\n{% else %}</s>{% endif %}")
    request = parse_body({"messages": [{"role": "user", "content": "Why?"}]}, ChatCompletionRequest)
    text = prompts.chat_text(request)
    assert prompts.turn_opening(request, text) == "<think>\n"
    assert answer_starts_inside("qwen3", request, lambda: prompts.turn_opening(request, text)) is True


def test_a_template_that_takes_the_messages_only_with_the_turn_opened_still_serves():
    """Its render without the opening raises: the opening is then read as none, not a 400 for a valid request."""
    prompts = _prompts("{% if not add_generation_prompt %}{{ raise_exception('open the turn') }}{% endif %}"
                       "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n")
    request = parse_body({"messages": [{"role": "user", "content": "Why?"}]}, ChatCompletionRequest)
    assert prompts.turn_opening(request, prompts.chat_text(request)) == ""
