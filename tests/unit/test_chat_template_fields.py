"""vLLM's chat-template fields on a chat request (and /tokenize): ``chat_template_kwargs`` reach the template as its
variables, ``continue_final_message`` leaves the final message open for the model to continue, and names the server
sets itself are a 400, on a ChatML template that reads Qwen3's ``enable_thinking``."""

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from app.api.errors import APIError
from app.api.prompts import Prompts
from app.api.protocol import ChatCompletionRequest, parse_body
from app.api.token_requests import TokenizeRequest

CHATML = (
    "{% if documents %}DOCS {% for d in documents %}{{ d['title'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]
PREFILL = {"role": "assistant", "content": "In Oslo it is"}


@pytest.fixture
def rendered() -> list[str]:
    return []


@pytest.fixture
def prompts(rendered) -> Prompts:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                        unk_token="[UNK]")
    tokenizer.chat_template = CHATML
    tokenizer.encode = lambda text, add_special_tokens=True: rendered.append(text) or [0]  # the text is what is tested
    return Prompts(tokenizer, "m", 64, 1)


def _chat(prompts: Prompts, rendered: list[str], **fields) -> str:
    prompts.chat(parse_body({"messages": CHAT, **fields}, ChatCompletionRequest))
    return rendered[-1]


def test_chat_template_kwargs_are_the_templates_variables(prompts, rendered):
    opened = "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    assert _chat(prompts, rendered) == opened
    assert _chat(prompts, rendered, chat_template_kwargs={"enable_thinking": False}) == opened + "<think>\n\n</think>\n\n"
    # a variable the template never reads changes nothing, as in vLLM (clients send enable_thinking to every model)
    assert _chat(prompts, rendered, chat_template_kwargs={"enable_thinking": True, "unused": 1}) == opened


def test_reasoning_effort_reaches_the_template_and_none_turns_its_thinking_off_unless_asked_otherwise(prompts, rendered):
    """As vLLM passes it: the template's ``reasoning_effort`` variable, and ``enable_thinking`` false for "none" (true
    otherwise) unless chat_template_kwargs set it; SmolLM2's template, reading neither, renders as without it."""
    opened = _chat(prompts, rendered)
    assert _chat(prompts, rendered, reasoning_effort="none") == opened + "<think>\n\n</think>\n\n"
    assert _chat(prompts, rendered, reasoning_effort="high") == opened
    assert _chat(prompts, rendered, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == opened
    with pytest.raises(APIError) as caught:
        _chat(prompts, rendered, reasoning_effort="extreme")
    assert caught.value.param == "reasoning_effort"


def test_a_responses_reasoning_effort_is_the_chat_requests(prompts, rendered):
    from app.api.responses import chat_body

    chat = chat_body({"model": "m", "input": "Weather in Oslo?", "reasoning": {"effort": "none", "summary": None}})
    assert chat["reasoning_effort"] == "none"
    prompts.chat(parse_body(chat, ChatCompletionRequest))
    assert rendered[-1].endswith("<think>\n\n</think>\n\n")


def test_an_earlier_answers_reasoning_replayed_and_a_name_reach_a_template_that_shows_them(prompts, rendered):
    """LiteLLM and the Agents SDK replay an answer with its ``reasoning_content`` (or ``reasoning``; null when there was
    none) and LiteLLM's ``provider_specific_fields``: accepted, the reasoning given to the template (Qwen3's shows it)."""
    prompts.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
        "{% endif %}{{ m['content'] }}\n{% endfor %}")
    answer = {"role": "assistant", "content": "Rain.", "provider_specific_fields": {"refusal": None}}
    for field in ("reasoning_content", "reasoning"):
        shown = _chat(prompts, rendered, messages=CHAT + [{**answer, field: "It is Oslo."}], add_generation_prompt=False)
        assert shown.endswith("assistant: <think>It is Oslo.</think>Rain.\n"), (field, shown)
    assert _chat(prompts, rendered, messages=CHAT + [{**answer, "reasoning_content": None}]).endswith("assistant: Rain.\n")
    named = [{**CHAT[0], "name": "ada"}]  # a participant's name, as vLLM passes it
    assert _chat(prompts, rendered, messages=named).startswith("user (ada): Weather in Oslo?")


def test_add_special_tokens_encodes_the_templates_text_with_the_tokenizers_own(prompts, rendered, monkeypatch):
    asked = []
    monkeypatch.setattr(prompts.tokenizer, "encode", lambda text, add_special_tokens=True: asked.append(add_special_tokens) or [0])
    prompts.chat(parse_body({"messages": CHAT}, ChatCompletionRequest))
    prompts.chat(parse_body({"messages": CHAT, "add_special_tokens": True}, ChatCompletionRequest))
    prompts._tokenized(parse_body({"messages": CHAT}, TokenizeRequest))  # /tokenize reads a chat as a chat request
    prompts._tokenized(parse_body({"messages": CHAT, "add_special_tokens": True}, TokenizeRequest))
    assert asked == [False, True, False, True]  # the template writes its own special tokens: none unless asked, as vLLM


def test_documents_reach_a_template_that_shows_them_as_a_field_or_a_variable(prompts, rendered):
    documents = [{"title": "Oslo", "text": "Rain."}, {"title": "Bergen", "text": "More rain."}]
    shown = _chat(prompts, rendered, documents=documents)
    assert shown.startswith("DOCS Oslo;Bergen;<|im_start|>user")  # (transformers trims a newline after a block tag)
    assert _chat(prompts, rendered, chat_template_kwargs={"documents": documents}) == shown


def test_continue_final_message_leaves_the_assistants_text_open(prompts, rendered):
    opened = _chat(prompts, rendered)
    continued = _chat(prompts, rendered, messages=CHAT + [PREFILL], continue_final_message=True)
    assert continued == opened + "In Oslo it is"  # no end of turn: the model writes on from "is"
    assert _chat(prompts, rendered, messages=CHAT + [PREFILL], continue_final_message=True,
                 add_generation_prompt=False) == continued
    closed = _chat(prompts, rendered, messages=CHAT + [PREFILL], add_generation_prompt=False)
    assert closed == continued + "<|im_end|>\n"


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs.conversations"),
    ({"documents": ["Oslo: rain"]}, "documents.0"),  # documents are objects
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
])
def test_what_the_server_sets_itself_or_a_wrong_type_is_a_400_naming_the_field(prompts, rendered, fields, param):
    with pytest.raises(APIError) as caught:
        _chat(prompts, rendered, **fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value


def test_tokenize_reads_a_chat_as_the_chat_request_does(prompts, rendered):
    fields = {"messages": CHAT + [PREFILL], "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    prompts._tokenized(parse_body(fields, TokenizeRequest))
    assert rendered[-1] == _chat(prompts, rendered, **fields)
    with pytest.raises(APIError) as caught:
        prompts._tokenized(parse_body({**fields, "add_generation_prompt": True}, TokenizeRequest))
    assert caught.value.param == "continue_final_message"


def test_documents_go_to_a_checkpoints_rag_template_and_are_a_400_where_the_template_would_drop_them():
    """Command R ships named templates: its documents show in "rag", as its tokenizer's grounded generation renders
    them; a template that reads no documents would drop them without a word."""
    from tests.unit.test_template_traits import _render

    named = {"default": "{% for m in messages %}{{ m.content }}{% endfor %}",
             "rag": "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"}
    body = {"messages": [{"role": "user", "content": "Biggest penguin?"}],
            "documents": [{"title": "Tall penguins", "text": "Emperors are the tallest."}]}
    assert _render(named, **body) == "[Tall penguins: Emperors are the tallest.]Biggest penguin?"
    with pytest.raises(APIError, match="shows no documents") as caught:
        _render(named["default"], **body)
    assert caught.value.status == 400 and caught.value.param == "documents"
    with pytest.raises(APIError, match="shows no documents"):  # passed as a template variable: the same
        _render(named["default"], messages=body["messages"], chat_template_kwargs={"documents": body["documents"]})
    tool_use = "{% for t in tools %}<{{ t.function.name }}>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(APIError, match="shows no documents"):  # tools take tool_use, which shows no documents: not "rag"
        _render({**named, "tool_use": tool_use}, **body, tools=[weather])  # (which would drop the tools)
