"""Grammars around markers a tokenizer may hold as tokens of their own (Qwen's <tool_call>, reasoning models'
</think>), on the embedded model's real tokenizer and engine: a reasoning model's structured output after its thinking
(app/api/reasoning.py ``after_thinking``: the thinking free until ``</think>``, as text or as one added token, then
the format holds the answer; speculation changes no token), and strict tools' calls opened by their marker."""

import re

import pytest
from tokenizers import AddedToken

from app.api.reasoning import after_thinking
from app.api.structured import request_grammar
from app.config import SpecConfig
from app.engine import Request, SamplingParams
from app.engine.grammar import Grammars
from tests.model.conftest import make_engine, run_engine

pytestmark = pytest.mark.model

DIGITS = request_grammar(None, {"regex": "[0-9]+"})
JSON = request_grammar({"type": "json_object"}, None)


def with_added(tokenizer, *markers: str, special: bool = False):
    """A copy of ``tokenizer`` with ``markers`` added as tokens of their own (as Qwen's and DeepSeek-R1's have them)."""
    added = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    added.add_tokens([AddedToken(marker, normalized=False, special=special) for marker in markers], special_tokens=special)
    return added


@pytest.fixture(scope="module")
def tokenizers(loaded_rounded):
    """The embedded tokenizer as it is (the markers are text), and with the markers as added tokens."""
    return {"text": loaded_rounded.tokenizer, "added": with_added(loaded_rounded.tokenizer, "<think>", "</think>")}


@pytest.mark.parametrize("markers", ["text", "added"])
@pytest.mark.parametrize("inside, text, accepted", [
    (True, 'Hmm, {"a": 1}? No.</think>\n\n{"a": 2}', True),  # the thinking may hold what the format would take
    (True, '{"a": 2}', False),  # still thinking: no answer yet
    (True, 'So.</think>no', None),  # after the thinking, the format or nothing
    (False, '{"a": 2}', True),  # thinking off: the answer at once ...
    (False, '\n<think>Hm.</think>{"a": 3}', True),  # ... or a block first (Qwen3 opens its own)
    (False, 'Hm.</think>{"a": 3}', None),
])
def test_the_grammar_frees_the_thinking_and_holds_the_answer(tokenizers, markers, inside, text, accepted):
    tokenizer = tokenizers[markers]
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    matcher = grammars.matcher(after_thinking(JSON, tokenizer, inside))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (tokenizer.convert_tokens_to_ids("</think>") in ids) is (markers == "added" and "</think>" in text)
    consumed = all(matcher.consume_token(t) for t in ids)
    assert (None if not consumed else matcher.is_accepting()) is accepted


PROMPTS = [
    "a</think>1 b</think>2 c</think>3 d</think>4 e",  # the model writes </think> soon (and n-grams draft past it)
    "Think first.</think>Answer: 42. Think again.</think>Answer: 7. Think",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>",  # never closes its block in 24 tokens
]


def _run(loaded, grammar, engine=None) -> list[str]:
    requests = [Request(str(i), loaded.tokenizer.encode(p), SamplingParams(max_tokens=24, temperature=0, grammar=grammar),
                        loaded.eos_token_ids) for i, p in enumerate(PROMPTS)]
    outputs = run_engine(engine or make_engine(loaded, max_model_len=512), requests)
    return [loaded.tokenizer.decode([t for t in outputs[r.request_id] if t not in loaded.eos_token_ids]) for r in requests]


def test_the_answer_after_the_thinking_follows_the_format_and_speculation_changes_no_token(loaded_rounded):
    free = _run(loaded_rounded, None)
    held = _run(loaded_rounded, after_thinking(DIGITS, loaded_rounded.tokenizer, inside=True))
    for free_text, text in zip(free, held):
        thought, closed, answer = text.partition("</think>")
        if not closed:  # no answer yet: the thinking is what the model writes unconstrained
            assert text == free_text
            continue
        assert free_text.startswith(thought + closed)  # free up to the marker, as the model writes it
        assert re.fullmatch(r"\s*[0-9]+", answer), text  # then the format
    assert sum("</think>" in text for text in held) == 2
    engine = make_engine(loaded_rounded, max_model_len=512, speculative=SpecConfig(drafter="ngram", num_speculative_tokens=4))
    assert _run(loaded_rounded, after_thinking(DIGITS, loaded_rounded.tokenizer, inside=True), engine) == held
    assert engine.stats()["spec_num_accepted_tokens"] > 0  # drafts were verified, the grammar's masks among them


@pytest.fixture(scope="module")
def call_tokenizers(loaded_rounded):
    """The embedded tokenizer as it is (Hermes' call markers are text), and with them as added tokens (Qwen's)."""
    return {"text": loaded_rounded.tokenizer, "added": with_added(loaded_rounded.tokenizer, "<tool_call>", "</tool_call>")}


@pytest.mark.parametrize("markers", ["text", "added"])
@pytest.mark.parametrize("text, accepted", [
    ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
    ("No call needed: it rains.", True),  # the text stays free
    ('<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>', None),  # a strict tool's schema holds
])
def test_strict_calls_match_the_call_markers_as_the_tokenizer_writes_them(call_tokenizers, markers, text, accepted):
    """Qwen's tokenizers add <tool_call> as a token of its own, which llguidance never reads as text: the grammar names
    that token, or the model could never open a call."""
    from app.api.tools import parse_tools, strict_calls

    tokenizer = call_tokenizers[markers]
    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    grammar = strict_calls(parse_tools([weather]), "hermes", parallel=True, tokenizer=tokenizer)
    matcher = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id})).matcher(grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (tokenizer.convert_tokens_to_ids("<tool_call>") in ids) is (markers == "added" and "<tool_call>" in text)
    consumed = all(matcher.consume_token(t) for t in ids)
    assert (None if not consumed else matcher.is_accepting()) is accepted
    if markers == "added" and "<tool_call>" in text:  # the marker spelled in pieces opens no call the grammar skips
        spelled_text = text.replace("<tool_call>", "<\0tool_call>").replace("</tool_call>", "<\0/tool_call>")
        pieces = [t for piece in spelled_text.split("\0") for t in tokenizer.encode(piece, add_special_tokens=False)]
        spelled = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id})).matcher(grammar)
        assert not all(spelled.consume_token(t) for t in pieces)


@pytest.mark.parametrize("special", [False, True])
def test_a_call_marker_the_tokenizer_calls_special_stays_in_the_text_the_calls_are_read_from(loaded_rounded, special):
    """Qwen's <tool_call> is an added token, not special; where a checkpoint adds it special, skip_special_tokens would
    take it out of the text and no call could be read: such a model's tool requests keep special tokens (as vLLM)."""
    from app.api.protocol import ChatCompletionRequest, parse_body
    from app.api.serving import OpenAIServing

    tokenizer = with_added(loaded_rounded.tokenizer, "<tool_call>", "</tool_call>", special=special)
    serving = OpenAIServing(None, tokenizer, "m", 2048, sorted(loaded_rounded.eos_token_ids), len(tokenizer))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather]}
    [plan] = serving._chat_plans(parse_body(body, ChatCompletionRequest))
    assert plan.sampling.skip_special_tokens is not special
    [plain] = serving._chat_plans(parse_body({**body, "tool_choice": "none"}, ChatCompletionRequest))
    assert plain.sampling.skip_special_tokens  # no call read: as asked
