"""Tool calls read as they are written (Hermes, Mistral, Qwen3-Coder, Llama 3): a stream, fed in any pieces, sends each call's name and
then its arguments as prefixes of what the whole answer reads, and assembles to it exactly."""

import random

import pytest

from app.api.tool_streams import StreamedCalls
from app.api.tools import parse_calls

# (parser, answer, its content and calls read whole). A call's arguments are the model's own JSON text.
HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    # a closing tag and braces inside a string are no end; text after the calls is content
    ('<tool_call>{"name": "f", "arguments": {"note": "a \\"}\\" </tool_call>", "list": [1, {"x": []}]}}</tool_call> after',
     "after", [("f", '{"note": "a \\"}\\" </tool_call>", "list": [1, {"x": []}]}')]),
    # other shapes are read whole once the block closes: keys in another order, arguments as a string
    ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>', None, [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}, "id": 7}</tool_call>', None, [("f", '{"a": 1}')]),  # a key after
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),  # Llama's key
    ('<tool_call>{"parameters": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),  # and reordered
    ('<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>', '<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": {}}\n</tool_cal', None, [("f", "{}")]),  # cut inside its closing tag
    ("<tool_call>{not json</tool_call> plain", "<tool_call>{not json</tool_call> plain", []),  # unreadable: content
    ("No call here, just <tool text. ", "No call here, just <tool text. ", []),
    ('Sure <tool_call>{"name": "f", "arguments": {"a": [1, 2', "Sure", [("f", '{"a": [1, 2')]),  # cut short: a call
    ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),  # cut before its arguments: no call
]
MISTRAL = [
    ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo",  "note": "a ]} b"}}, {"name": "t", "arguments": {}}]',
     "Checking.", [("get_weather", '{"city": "Oslo",  "note": "a ]} b"}'), ("t", "{}")]),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"arguments": {"b": 2}, "name": "g"}]', None,
     [("f", '{"a": 1}'), ("g", '{"b": 2}')]),  # a call in another shape: read from the whole list
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1', None, [("f", '{"a": [1')]),  # cut short: a call
    ("[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ('[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]', None, [("f", '{"a": 1}')]),  # arguments as a string
    ('[TOOL_CALLS] [{"name": "f", "arguments": {}}]\n\nI called f.', "I called f.", [("f", "{}")]),  # text after: content
    ('[TOOL_CALLS] [{"name": "f\n", "arguments": {}}]', '[TOOL_CALLS] [{"name": "f\n", "arguments": {}}]', []),  # no name
    ("No calls [TOOL", "No calls [TOOL", []),
    # v11 on: name[ARGS]{...} after a marker each, an id or not, [ARGS] left out or not
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "note": "a} [TOOL_CALLS]"}[TOOL_CALLS]t[ARGS]{}', "Checking.",
     [("get_weather", '{"city": "Oslo", "note": "a} [TOOL_CALLS]"}'), ("t", "{}")]),
    ('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"a": [1, {"b": 2}]}\n[TOOL_CALLS]g{"c": 3}', None,
     [("f", '{"a": [1, {"b": 2}]}'), ("g", '{"c": 3}')]),
    ('[TOOL_CALLS]f[ARGS]{"a": "Os', None, [("f", '{"a": "Os')]),  # cut short: a call
    ('[TOOL_CALLS]f[ARGS]{}\n\nI called f.', "I called f.", [("f", "{}")]),  # text after: content
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]oops text", "[TOOL_CALLS]oops text", [("f", "{}")]),  # the marker stays with it
]
QWEN3_CODER = [  # no tools given: every value stays text
    ("On it.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\ntwo\n</parameter>\n</function>\n"
     "</tool_call>", "On it.", [("f", '{"a": "1", "b": "two"}')]),
    ("<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call> done", "done",
     [("f", '{"a": "x", "b": "y"}')]),  # closing tags left out
    ("<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n<parameter=b>\nyy", None, [("f", '{"a": "x"')]),  # cut short
    ("<tool_call>\n<funct", "<tool_call>\n<funct", []),
    # a block whose end tag is left out ends with its function: the next block is a call of its own
    ("<tool_call>\n<function=f>\n</function>\nmid <tool_call>\n<function=g>\n</function>\n</tool_call>", "mid",
     [("f", "{}"), ("g", "{}")]),
    ("A <tool_call>\n<function=f>\n</function>\n</tool_call> B", "A  B", [("f", "{}")]),  # content around a call
    ("<tool_call> no function <tool_call>\n<function=f>\n</function>\n</tool_call>", "<tool_call> no function", [("f", "{}")]),
]
LLAMA3 = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "t", "parameters": {}}', None,
     [("get_weather", '{"city": "Oslo"}'), ("t", "{}")]),
    (' {"parameters": {"a": 1}, "name": "f"}', None, [("f", '{"a": 1}')]),  # another shape: read whole at the end
    ('{"name": "f", "parameters": {"a": "b', None, [("f", '{"a": "b')]),  # cut short: a call
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call
    ('{"name": "f", "parameters": {}}\nThe weather is fine.', "The weather is fine.", [("f", "{}")]),  # text after
    ('{"name": "f", "parameters": {}}; {"parameters": {"b": 2}, "name": "g"}', None, [("f", "{}"), ("g", '{"b": 2}')]),
    ("It is 4 pm.", "It is 4 pm.", []),
]
ANSWERS = ([("hermes", *case) for case in HERMES] + [("mistral", *case) for case in MISTRAL]
           + [("qwen3_coder", *case) for case in QWEN3_CODER] + [("llama3_json", *case) for case in LLAMA3])


@pytest.mark.parametrize("parser, answer, content, calls", ANSWERS)
def test_a_whole_answer_reads_as_its_content_and_calls(parser, answer, content, calls):
    found_content, found = parse_calls(answer, parser)
    assert (found_content, [(c.name, c.arguments) for c in found]) == (content, calls)


def _pieces(text: str, how: str) -> list[str]:
    if how == "chars":
        return list(text)
    rng, pieces, at = random.Random(f"{how}{text}"), [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[at:at + step])
        at += step
    return pieces


@pytest.mark.parametrize("how", ["chars", "seed-1", "seed-2"])
@pytest.mark.parametrize("parser, answer, content, calls", ANSWERS)
def test_a_stream_sends_prefixes_of_the_whole_reading_and_assembles_to_it(parser, answer, content, calls, how):
    stream, released = StreamedCalls(parser), ""
    for piece in _pieces(answer, how):
        released += stream.feed(piece)
        assert content is not None and content.startswith(released) or not released
        so_far = stream.calls
        assert len(so_far) <= len(calls)
        for (name, arguments), (whole_name, whole_arguments) in zip(so_far, calls):
            assert name == whole_name and whole_arguments.startswith(arguments)  # never taken back
    rest, found = stream.finish()
    assert (released + (rest or "") or None, [(c.name, c.arguments) for c in found]) == (content, calls)


def test_a_calls_name_goes_out_before_its_arguments_are_written():
    stream = StreamedCalls("hermes")
    stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert stream.calls == [("get_weather", '{"ci')]
    stream.feed('ty": "Oslo"}}</tool_call>')
    assert stream.calls == [("get_weather", '{"city": "Oslo"}')]
