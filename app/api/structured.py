"""Structured outputs at the API: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` become one
llguidance grammar (``SamplingParams.grammar``), checked here, so that a schema the grammar engine cannot
honour is a 400 naming what it lacks, before the request reaches an engine.

JSON follows the schema with compact separators (``", "``, ``": "``) and no other whitespace: a small model
cannot then spend its whole budget on blank lines inside an object. Schemas are read as ``app/api/schemas.py``
says (an object listing its properties takes no others, as vLLM's default backend reads it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.api.errors import NOT_JSON, APIError
from app.api.schemas import closed
from app.engine.bounded_cache import BoundedCache
from app.engine.deep_stack import on_a_deep_stack

# What the JSON grammar allows between tokens (a schema's own "x-guidance" options override these).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the kind: what the grammar here does either way (no free whitespace; listed properties only;
# no other grammar engine to fall back to)
STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
STRUCTURED_UNSET_ONLY = {"whitespace_pattern": "JSON is written with compact separators",
                         "structural_tag": "give the format as json, regex, choice or grammar"}
# A grammar is compiled for the model's vocabulary in the engine, between its steps: what a schema may hold keeps that
# within a fraction of a second (2-core AVX2 EPYC, SmolLM2's vocabulary: an object of 1,000 optional properties
# 0.14 s, of 4,000 2.0 s, of 10,000 25 s; 16 objects of 500 0.87 s, 20 of 1,000 2.5 s and then a crash inside
# llguidance; every request of the batch waited). And llguidance holds 2,000 parser items at a position: an object's
# optional properties take 4 each there (499 failed at its "{"), a choice one more than its count.
MAX_PROPERTIES = 480  # of one object
MAX_ALL_PROPERTIES = 4000  # of all a schema's objects
# A grammar's or regex's text: 12,000 alternatives (121k characters) 0.3 s, 50,000 (640k) 4.4 s, 80,000 past what
# llguidance holds (same machine)
MAX_GRAMMAR_CHARS = 131_072
MAX_LISTED = 1999  # enum values, or choices
MAX_SCHEMA_NODES = 4096  # objects in a whole schema
_ANY_OBJECT = json.dumps({"type": "object"})  # json_object: any JSON object


def request_grammar(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None) -> str | None:
    """The llguidance grammar a request's output must follow, or None for free text."""
    found = request_format(response_format, structured_outputs)
    if found is None:
        return None
    (kind, text), param = found
    return compiled(kind, text, param)


def request_format(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None):
    """((kind, text), the field that gave it) of a request's format, or None for free text."""
    from_format = _from_response_format(response_format)
    from_extra = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise APIError(400, "give either response_format or structured_outputs, not both", param="structured_outputs")
    return from_format or from_extra


def json_in_lark(schema_text: str) -> str:
    """A JSON schema as a Lark grammar's ``%json`` value, held to the separators JSON_OPTIONS gives (its own
    "x-guidance" options still override them)."""
    schema = json.loads(schema_text)
    options = schema.get("x-guidance") or {}
    if not isinstance(options, dict):
        raise APIError(400, "a schema's x-guidance must be an object of llguidance's JSON options", code="invalid_grammar")
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **options}})


# The keys each response_format type takes (json_object's "schema": llama.cpp's and Together's form, honoured)
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name": str, "description": str, "strict": bool, "schema": dict}


def _from_response_format(response_format: dict[str, Any] | None):
    if response_format is None:
        return None
    kind = response_format.get("type")
    param = "response_format"
    if kind not in _FORMAT_KEYS:
        raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                       param="response_format.type")
    _only(response_format, _FORMAT_KEYS[kind], param, f"with type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise APIError(400, "response_format.schema must be a JSON schema object", param="response_format.schema")
        return ("json", json.dumps(closed(schema, "response_format.schema")) if schema else _ANY_OBJECT), param
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)",
                       param="response_format.json_schema.schema")
    _only(spec, set(_JSON_SCHEMA_KEYS), "response_format.json_schema")
    for key, kind_of in _JSON_SCHEMA_KEYS.items():
        if key in spec and spec[key] is not None and not isinstance(spec[key], kind_of):
            raise APIError(400, f"response_format.json_schema.{key} must be a {kind_of.__name__}",
                           param=f"response_format.json_schema.{key}")
    return ("json", json.dumps(closed(spec["schema"], "response_format.json_schema.schema"))), param


def _only(given: dict, known: set[str], param: str, where: str = "") -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise APIError(400, f"{param} {where + ' ' if where else ''}does not take {', '.join(unknown)} "
                       f"(it takes {', '.join(sorted(known))})", param=f"{param}.{unknown[0]}")


def _from_structured_outputs(structured: dict[str, Any] | None):
    if structured is None:
        return None
    for key in STRUCTURED_FLAGS:
        if not isinstance(structured.get(key, False), bool):
            raise APIError(400, f"structured_outputs.{key} must be true or false", param=f"structured_outputs.{key}")
    for key, why in STRUCTURED_UNSET_ONLY.items():
        if structured.get(key) is not None:
            raise APIError(400, f"structured_outputs.{key} is not supported: {why} (leave it unset)",
                           param=f"structured_outputs.{key}")
    structured = {key: value for key, value in structured.items() if key not in (*STRUCTURED_FLAGS, *STRUCTURED_UNSET_ONLY)}
    given = [key for key, value in structured.items() if value is not None and value is not False]
    if not isinstance(structured.get("json_object", False), bool) and structured["json_object"] is not None:
        raise APIError(400, "structured_outputs.json_object must be true", param="structured_outputs.json_object")
    unknown = [key for key in structured if key not in STRUCTURED_KINDS]
    if unknown or len(given) != 1:
        raise APIError(400, f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}"
                       + (f"; unknown: {', '.join(unknown)}" if unknown else ""), param="structured_outputs")
    kind, value = given[0], structured[given[0]]
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return ("json", _ANY_OBJECT), param
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except NOT_JSON as exc:
            raise APIError(400, f"structured_outputs.json is not valid JSON: {str(exc) or 'nested too deeply'}", param=param) from None
        if not isinstance(schema, dict):
            raise APIError(400, "structured_outputs.json must be a JSON schema object", param=param)
        return ("json", json.dumps(closed(schema, param))), param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, "structured_outputs.choice must be a non-empty list of non-empty strings", param=param)
        return ("choice", json.dumps(value)), param
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string", param=param)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{param} has {len(value):,} characters; at most {MAX_GRAMMAR_CHARS:,} are compiled "
                       "(the engine compiles it between its steps, while its batch waits)", param=param)
    return (kind, value), param


_COMPILED = BoundedCache(entries=256, size=64 << 20)  # (kind, text) -> (grammar, why not); 64 M characters in all


def _grammar(kind: str, text: str) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, why it cannot be used), compiled once (kept), where a long chain of references cannot
    overflow the stack (app/engine/deep_stack.py)."""
    found = _COMPILED.get((kind, text))
    if found is None:
        found = on_a_deep_stack(lambda: _compiled_grammar(kind, text))
        _COMPILED.put((kind, text), found, len(text) + len(found[0] or ""))
    return found


def _compiled_grammar(kind: str, text: str) -> tuple[str | None, str | None]:
    import llguidance

    if kind in ("json", "choice") and (why := _too_large(json.loads(text))):
        return None, why
    if kind == "grammar" and (why := next(filter(None, map(_too_large, _json_in_grammar(text))), None)):
        return None, why  # a schema inside a Lark grammar is a schema
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "grammar":  # GBNF rules are written `name ::= ...`; Lark's `name: ...` (also `?name:`)
            grammar = llguidance.grammar_from("gbnf" if "::=" in text else "lark", text)
        elif kind == "lark":  # ours (app/api/tools.py), whatever its JSON holds
            grammar = llguidance.grammar_from("lark", text)
        else:  # regex, choice
            grammar = llguidance.grammar_from(kind, text)
    except ValueError as exc:
        return None, str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (None, messages[0]) if is_error else (grammar, None)


def token_or_text(tokenizer, text: str) -> str:
    """``text`` in a Lark rule: ``<[id]>`` where it is one token the tokenizer added (Qwen's ``<tool_call>``, reasoning
    models' ``</think>``: llguidance reads every added token as special, never as the text it writes), else a string."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    if len(ids) == 1 and ids[0] in (getattr(tokenizer, "added_tokens_decoder", None) or {}):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def special_token(tokenizer, text: str) -> bool:
    """Whether ``text`` is one token the tokenizer leaves out of text under ``skip_special_tokens`` (a marker that
    requests reading it, a call's or a thinking's, must keep special tokens in their text)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""


def require_compilable_size(value: Any, param: str) -> None:
    """A 400 naming ``param`` for a schema past what the engine compiles promptly (the limits above)."""
    if why := _too_large(value):
        raise APIError(400, f"{param} cannot be used: {why}", param=param, code="invalid_grammar")


def _json_in_grammar(text: str) -> list[Any]:
    """The schemas a Lark grammar holds as ``%json {...}`` values."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(r"%json\s*", text):
        try:
            found.append(decoder.raw_decode(text, match.end())[0])
        except NOT_JSON:
            continue  # not JSON: llguidance says what is wrong
    return found


def _too_large(value: Any) -> str | None:
    """Why a schema (or choice list) is past what the engine compiles promptly, or None."""
    nodes, all_properties, pending = 0, 0, [value]
    over = isinstance(value, list) and len(value) > MAX_LISTED
    written = _chars(value) if isinstance(value, list) else 0  # what the grammar spells out: choices, enums, patterns
    while pending and not over:
        node = pending.pop()
        if isinstance(node, dict):
            nodes += 1
            properties, enum = node.get("properties"), node.get("enum")
            written += _chars(enum) + _chars(node.get("const")) + _chars(node.get("pattern"))
            all_properties += len(properties) if isinstance(properties, dict) else 0
            over = (isinstance(properties, dict) and len(properties) > MAX_PROPERTIES) or nodes > MAX_SCHEMA_NODES or \
                (isinstance(enum, list) and len(enum) > MAX_LISTED) or written > MAX_GRAMMAR_CHARS or \
                all_properties > MAX_ALL_PROPERTIES
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    over = over or written > MAX_GRAMMAR_CHARS
    return (f"too large to compile without holding up the engine: at most {MAX_PROPERTIES} properties in an object "
            f"({MAX_ALL_PROPERTIES:,} in all), {MAX_LISTED:,} enum values or choices, {MAX_SCHEMA_NODES:,} schema "
            f"objects, {MAX_GRAMMAR_CHARS:,} characters of choices, enum values and patterns in all") if over else None


def _chars(value: Any) -> int:
    """The characters of a string, or of the strings of a list."""
    if isinstance(value, str):
        return len(value)
    return sum(len(item) for item in value if isinstance(item, str)) if isinstance(value, list) else 0


def compiled(kind: str, text: str, param: str) -> str:
    grammar, error = _grammar(kind, text)
    if error is not None:
        raise APIError(400, f"{param} cannot be used: {error.strip()}", param=param, code="invalid_grammar")
    return grammar
