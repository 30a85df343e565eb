"""The Responses API's ``truncation: "auto"``: an input past the model's context loses its oldest turns (a leading
system message stays, what is left starts at a user message) until it fits, the fewest dropped; ``disabled`` (the
default) leaves it to the context's 400. On the serving layer with the fake model's tokenizer (one token per byte)
and a 100-token context."""

import pytest

from app.api.errors import APIError
from app.api.responses import parse_request
from app.api.serving import OpenAIServing
from tests.serve.fake_model import ByteTokenizer

CONTEXT = 100


def _turns(count: int) -> list[dict]:
    turns = []
    for i in range(count):
        turns += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return turns + [{"role": "user", "content": "last question"}]


def _prompt(input_items: list[dict], truncation: str | None = None, **fields) -> str:
    serving = OpenAIServing(None, ByteTokenizer(), "m", CONTEXT, [0], 256)
    body = {"model": "m", "instructions": "Be brief.", "input": input_items, **({"truncation": truncation} if truncation else {}),
            **fields}
    _, request = parse_request(str.encode(__import__("json").dumps(body)))
    [plan] = serving._chat_plans(request)
    return bytes(plan.prompt_token_ids).decode()


def test_auto_drops_the_oldest_turns_until_the_input_fits_keeping_the_instructions():
    assert _prompt(_turns(1), "auto") == _prompt(_turns(1))  # it fits: as it was
    prompt = _prompt(_turns(6), "auto")
    assert len(prompt) < CONTEXT and prompt.startswith("system: Be brief.\nuser: question ")
    assert prompt.endswith("user: last question\nassistant:")
    kept = prompt.count("question ")  # the most turns that fit: one more would not
    assert len(_prompt(_turns(6)[-(2 * kept + 1):], "auto")) == len(prompt)
    one_more = "system: Be brief.\n" + "\n".join(f"{t['role']}: {t['content']}" for t in _turns(6)[-(2 * kept + 1) - 2:])
    assert len(one_more + "\nassistant:") >= CONTEXT


def test_disabled_or_a_last_turn_past_the_context_is_the_contexts_400():
    for truncation, items in ((None, _turns(6)), ("disabled", _turns(6)), ("auto", [{"role": "user", "content": "x" * 200}])):
        with pytest.raises(APIError) as caught:
            _prompt(items, truncation)
        assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    with pytest.raises(APIError) as caught:
        parse_request(b'{"model": "m", "input": "hi", "truncation": "middle"}')
    assert caught.value.param == "truncation"


def test_auto_leaves_room_for_the_answer_asked_for_up_to_half_the_context():
    assert len(_prompt(_turns(6), "auto", max_output_tokens=40)) <= CONTEXT - 40
    assert len(_prompt(_turns(6), "auto", max_output_tokens=90)) <= CONTEXT // 2  # a longer answer: half the context
    assert len(_prompt(_turns(6), "auto", max_output_tokens=40)) < len(_prompt(_turns(6), "auto"))


def test_an_input_with_no_user_turn_to_start_at_is_the_contexts_400_not_an_orphaned_result():
    items = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 150},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "42"}]
    with pytest.raises(APIError) as caught:
        _prompt(items, "auto")
    assert caught.value.code == "context_length_exceeded"


def test_auto_keeps_a_developer_item_beside_the_instructions():
    prompt = _prompt([{"role": "developer", "content": "Metric."}, *_turns(6)], "auto")
    assert len(prompt) < CONTEXT and prompt.startswith("system: Be brief.\nsystem: Metric.\nuser: ")
