"""Structured-output fields at the API: what becomes a grammar, and each way a request is refused with a 400."""

import json
import os

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _grammar(body: dict, cls=ChatCompletionRequest) -> str | None:
    return parse_body(body, cls).sampling_params(16).grammar


def test_each_form_becomes_a_grammar_and_text_stays_free():
    assert _grammar({**CHAT, "response_format": {"type": "text"}}) is None
    assert _grammar(CHAT) is None
    forms = [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"grammar": 'start: "yes" | "maybe"'}},
        {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},  # GBNF, as llama.cpp writes it
    ]
    grammars = [_grammar({**CHAT, **form}) for form in forms]
    assert all(isinstance(g, str) and g for g in grammars)
    assert grammars[1] == grammars[2]  # one schema, by OpenAI's field or vLLM's: one grammar
    assert len(set(grammars)) == len(grammars) - 1
    completion = {"model": "m", "prompt": "hi", "structured_outputs": {"regex": "[a-z]+"}}
    assert _grammar(completion, CompletionRequest) == grammars[3]
    flags = {"disable_any_whitespace": True, "disable_additional_properties": False, "whitespace_pattern": None}
    assert _grammar({**CHAT, "structured_outputs": {"json": SCHEMA, **flags}}) == grammars[2]  # vLLM's options: as here


@pytest.mark.parametrize("form, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"structured_outputs": {"json": {"type": "object", "propertyNames": {"maxLength": 3}}}}, "structured_outputs.json", "propertyNames"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs", "unknown: xml"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strcit": True}}},
     "response_format.json_schema.strcit", "does not take strcit"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "must be a bool"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema", "does not take"),
    ({"structured_outputs": {"json_object": 0}}, "structured_outputs.json_object", "must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern", "compact"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"k{i}"' for i in range(20_000))}},
     "structured_outputs.grammar", "at most 131,072"),
    ({"structured_outputs": {"regex": "|".join(f"k{i}" for i in range(30_000))}}, "structured_outputs.regex", "at most"),
    ({"structured_outputs": {"choice": ["k" * 1000] * 200}}, "structured_outputs.choice", "131,072 characters"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "a" * 140_000}}}, "structured_outputs.json", "characters"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "structured_outputs.disable_any_whitespace",
     "true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {**SCHEMA, "required": 5}}}},
     "response_format.json_schema.schema", '"required" must be a list of property names'),
    ({"structured_outputs": {"json": {"type": "array", "items": {**SCHEMA, "required": [["city"]]}}}},
     "structured_outputs.json", '"required" must be a list'),
    ({"structured_outputs": {"json": {"type": "object", "properties": {f"p{i}": {} for i in range(481)}}}},
     "structured_outputs.json", "at most 480 properties"),  # llguidance could not open its "{"
    ({"structured_outputs": {"json": {"type": "object", "properties": {
        f"o{j}": {"type": "object", "properties": {f"p{i}": True for i in range(400)}} for j in range(11)}}}},
     "structured_outputs.json", "4,000 in all"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(2000)]}}, "structured_outputs.choice", "1,999"),
    ({"structured_outputs": {"grammar": "start: %json " + json.dumps({"type": "object", "properties": {
        f"p{i}": {} for i in range(2000)}})}}, "structured_outputs.grammar", "at most 480 properties"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(form, param, says):
    with pytest.raises(APIError) as caught:
        _grammar({**CHAT, **form})
    assert caught.value.status == 400 and caught.value.param == param and says in caught.value.message, caught.value.message


def test_grammar_masks_land_on_the_logits_device():
    """llguidance writes its bitmask in host memory; the logits may be on a GPU (here the meta device stands for one:
    mixing devices raises there as on CUDA)."""
    import torch

    from app.engine.grammar import _write_masks

    _write_masks(torch.zeros(2, 40, device="meta"), torch.zeros(2, 2, dtype=torch.int32))
    logits, bits = torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = 0b101
    _write_masks(logits, bits)
    assert logits[0, :4].tolist() == [0.0, float("-inf"), 0.0, float("-inf")]


def _accepts(grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_an_object_listing_its_properties_takes_no_others_and_json_object_honours_a_schema():
    """As vLLM's default backend reads a schema (OpenAI's strict mode requires it): a model cannot invent keys; a
    free-form object and what an allOf combines stay open; llama.cpp's json_object with a schema is that schema."""
    nested = {"type": "object", "properties": {"a": {"type": "integer"}, "meta": {"type": "object"},
                                               "child": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    grammar = _grammar({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested}}})
    assert _accepts(grammar, '{"a": 1, "meta": {"any": 2}, "child": {"b": "x"}}')
    assert not _accepts(grammar, '{"a": 1, "weather": "x"}') and not _accepts(grammar, '{"child": {"b": "x", "c": 1}}')
    combined = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                          {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": combined}}), '{"a": 1, "b": 2}')
    opened = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": opened}}), '{"a": 1, "z": 2}')
    nullable = {"type": "object", "properties": {"a": {"type": "integer", "nullable": True},  # OpenAPI's, pydantic v1's
                                                 "b": {"type": ["string", "integer"], "nullable": True},
                                                 "c": {"enum": ["x", "y"], "nullable": True}}}
    nullable = _grammar({**CHAT, "structured_outputs": {"json": nullable}})
    assert _accepts(nullable, '{"a": null, "b": null, "c": null}') and _accepts(nullable, '{"b": 2, "c": "x"}')
    assert not _accepts(nullable, '{"c": "z"}')
    tuples = {"type": "array", "items": [{"type": "object", "properties": {"a": {"type": "integer"}}}],  # draft 4's tuple
              "additionalItems": {"type": "object", "properties": {"b": {"type": "integer"}}}}
    tuples = _grammar({**CHAT, "structured_outputs": {"json": tuples}})
    assert _accepts(tuples, '[{"a": 1}, {"b": 2}]') and not _accepts(tuples, '[{"a": 1, "zzz": 2}]')
    assert not _accepts(tuples, '[{"a": 1}, {"b": 2, "zzz": 3}]')
    with_schema = _grammar({**CHAT, "response_format": {"type": "json_object", "schema": SCHEMA}})
    assert _accepts(with_schema, '{"a": 1}') and not _accepts(with_schema, '{"a": "one"}')


def test_a_lark_grammar_opening_with_an_inlined_rule_is_read_as_lark():
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"grammar": '?start: "yes" | "no"'}}), "no")


def test_what_combines_with_other_schemas_stays_open():
    """Inheritance (allOf over a $ref'd base), an object's own properties beside anyOf members, and a required key the
    properties do not list: schemas that read as their authors meant them before objects were closed."""
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    inherited = {"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"},
                                                    {"type": "object", "properties": {"extra": {"type": "string"}}, "required": ["extra"]}]}
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": inherited}}), '{"id": 1, "extra": "x"}')
    beside = {"type": "object", "properties": {"a": {"type": "integer"}},
              "anyOf": [{"properties": {"b": {"type": "integer"}}}, {"properties": {"c": {"type": "integer"}}}]}
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": beside}}), '{"a": 1, "b": 2}')
    unlisted = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": unlisted}}), '{"a": 1, "b": 2}')
    described = {"$defs": {"Street": {"type": "object", "properties": {"name": {"type": "string"}}}}, "type": "object",
                 "properties": {"street": {"$ref": "#/$defs/Street", "description": "where"}}}  # pydantic v2's form
    grammar = _grammar({**CHAT, "structured_outputs": {"json": described}})
    assert _accepts(grammar, '{"street": {"name": "Main"}}') and not _accepts(grammar, '{"street": {"name": "Main", "no": 1}}')


_CHAINED = """
import json, sys
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, parse_body

links = int(sys.argv[1])  # a schema of objects each holding the next: the compiler recurses once per link
defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]} for i in range(links)}
defs[f"d{links}"] = {"type": "integer"}
schema = {"$ref": "#/$defs/d0", "$defs": defs}
body = {"messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}}}
try:
    print("compiled" if parse_body(json.dumps(body), ChatCompletionRequest).grammar() else "none")
except APIError as error:
    print("400", error.message)
"""


def test_a_long_chain_of_references_is_a_400_where_it_crashed_the_process():
    """A 136 KB schema of 1,500 chained objects overflowed llguidance's compiler's stack and the process died (a
    replica, and every request on it): now refused by the size limit, and grammars compile on a 1 GiB stack (app/engine/
    deep_stack.py). In a child process here, so that a crash fails the test, not the run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _CHAINED, "1500"], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, (done.returncode, done.stderr[-1000:])
    assert done.stdout.startswith("400 response_format cannot be used: too large to compile"), done.stdout


@pytest.mark.parametrize("structured, param", [
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1001)}}}, "structured_outputs.json"),
    ({"json": {"enum": [f"v{i}" for i in range(2001)]}}, "structured_outputs.json"),
    ({"json": {"type": "array", "prefixItems": [{"type": "object"} for _ in range(4096)]}}, "structured_outputs.json"),
    ({"choice": [f"c{i}" for i in range(2001)]}, "structured_outputs.choice"),
])
def test_a_schema_the_engine_would_take_seconds_to_compile_is_a_400_and_one_at_the_limits_compiles(structured, param):
    """The engine compiles a grammar for the vocabulary between its steps: an object of 10,000 optional properties took
    25 s of it, with every request of the batch waiting."""
    with pytest.raises(APIError) as refused:
        parse_body({"prompt": "x", "structured_outputs": structured}, CompletionRequest).grammar()
    assert (refused.value.status, refused.value.param) == (400, param) and "too large to compile" in refused.value.message
    at_limit = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(2 if i else 1999)]} for i in range(480)}}
    assert parse_body({"prompt": "x", "structured_outputs": {"json": at_limit}}, CompletionRequest).grammar()


def test_vllms_older_guided_fields_are_read_as_structured_outputs():
    def grammar(**fields):
        return parse_body({"prompt": "a", **fields}, CompletionRequest).grammar()

    for old, kind, value in (("guided_json", "json", {"type": "object", "properties": {"a": {"type": "integer"}}}),
                             ("guided_regex", "regex", "[0-9]+"), ("guided_choice", "choice", ["yes", "no"]),
                             ("guided_grammar", "grammar", 'start: "a" | "b"')):
        assert grammar(**{old: value, "guided_decoding_backend": "xgrammar"}) == grammar(structured_outputs={kind: value})
    assert grammar(structured_outputs={"regex": "a", "disable_fallback": False}) == grammar(structured_outputs={"regex": "a"})
    with pytest.raises(APIError, match="not both"):
        grammar(guided_regex="a", structured_outputs={"regex": "b"})


def test_alternatives_of_a_value_are_closed_as_the_value_itself_would_be():
    """pydantic's Optional[Model] and Union[Cat, Dog]: anyOf/oneOf members with no object keys beside them are each a
    whole value, closed as one; the model used elsewhere stays closed there too."""
    address = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}
    schema = {"$defs": {"Address": address}, "type": "object",
              "properties": {"home": {"$ref": "#/$defs/Address"}, "alt": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
                             "pet": {"oneOf": [{"type": "object", "properties": {"meow": {"type": "boolean"}}, "required": ["meow"]},
                                               {"type": "object", "properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}]}}}
    grammar = _grammar({**CHAT, "structured_outputs": {"json": schema}})
    assert _accepts(grammar, '{"home": {"street": "a"}, "alt": null, "pet": {"meow": true}}')
    assert not _accepts(grammar, '{"home": {"street": "a", "zzz": 1}}')
    assert not _accepts(grammar, '{"alt": {"street": "a", "zzz": 1}}')
    assert not _accepts(grammar, '{"pet": {"meow": true, "bark": true}}')  # closed branches: one of them, as meant


def test_alternatives_that_combine_with_an_allof_or_a_reference_stay_open():
    """OpenAPI's polymorphism: alternatives inside an allOf member, beside a $ref, or a definition of alternatives
    referenced from an allOf combine with the rest, and the object they make takes every part's keys."""
    base = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    cat = {"type": "object", "properties": {"meow": {"type": "boolean"}}, "required": ["meow"]}
    dog = {"type": "object", "properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}
    pets = {"Base": base, "Cat": cat, "Dog": dog, "Pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}
    for schema, text in (({"allOf": [base, {"anyOf": [cat, dog]}]}, '{"name": "x", "meow": true}'),
                         ({"$defs": pets, "$ref": "#/$defs/Base", "anyOf": [cat, dog]}, '{"name": "x", "meow": true}'),
                         ({"$defs": pets, "allOf": [{"$ref": "#/$defs/Pet"}, base]}, '{"meow": true, "name": "x"}')):  # keys in
        assert _accepts(_grammar({**CHAT, "structured_outputs": {"json": schema}}), text), schema  # the schema's order
