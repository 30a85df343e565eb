"""JSON schemas as the output grammar takes them, from what clients send.

- An object schema that lists its ``properties`` takes no others unless it says ``additionalProperties``, as vLLM's
  default grammar backend (xgrammar's strict mode) reads it and as OpenAI's strict mode requires: the JSON Schema
  default would let a model invent keys (a weather tool's arguments grew a ``"weather"`` key). What combines with
  other schemas stays open (an object beside ``allOf``/``anyOf``/``oneOf``/``$ref``/``if``; ``allOf``'s members, and
  ``anyOf``'s and ``oneOf``'s where something stands beside them or their schema combines itself; the definitions
  they reference), as does an object whose ``required`` names a key it does not list and one without ``properties``
  (free-form). Alternatives with nothing beside them (pydantic's ``Optional[Model]``, ``Union[Cat, Dog]``) are each a
  whole value, closed.
- OpenAPI's ``"nullable": true`` (pydantic v1, FastAPI) becomes a type list with ``"null"`` (a schema without a type:
  ``anyOf`` it or null).
- ``tool_choice: required`` nests each tool's parameters inside one schema: their ``$defs``/``definitions`` move to
  its root (under names of each tool's own where two tools define one name differently) and their references to their
  own root (``"$ref": "#"``) follow them (``tools_schema``).
"""

from __future__ import annotations

import json
from typing import Any

from app.api.errors import APIError

_COMBINING = ("allOf", "anyOf", "oneOf", "if", "then", "else", "not", "$ref")  # what combines with an object's own keys
# What anyOf/oneOf members combine with where it stands beside them (without any, each member is a whole value)
_BESIDE_ALTERNATIVES = (*_COMBINING, "properties", "patternProperties", "additionalProperties", "required",
                        "dependentSchemas")
# Keys beside a "$ref" that combine with what it references (a description or title does not)
_COMBINED_WITH = {"properties", "patternProperties", "additionalProperties", "required", "allOf", "anyOf", "oneOf", "type"}


class _NotASchema(ValueError):
    """A part of a schema that no JSON schema has (the message says which)."""


def closed(schema: Any, param: str = "tools") -> Any:
    """``schema`` with the rules above applied throughout (a new object; ``schema`` is left as it is); a 400 naming
    ``param`` where a keyword has a value no schema gives it."""
    try:
        return _closed(schema, _with_their_alternatives(schema, _combined_definitions(schema)), open_here=False)
    except _NotASchema as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_grammar") from None


def _closed(schema: Any, combined: set[str], open_here: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    required = out.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(name, str) for name in required)):
        raise _NotASchema(f"a JSON schema's \"required\" must be a list of property names, not {json.dumps(required)[:80]}")
    if out.pop("nullable", None) is True:  # OpenAPI's: null too
        kind = out.get("type")
        if not isinstance(kind, (str, list)):  # no type (an enum, a reference, a combination): null beside it
            return {"anyOf": [_closed(out, combined, open_here), {"type": "null"}]}
        out["type"] = [kind, "null"] if isinstance(kind, str) else [*kind, *(["null"] if "null" not in kind else [])]
    properties = out.get("properties")
    if (isinstance(properties, dict) and "additionalProperties" not in out and not open_here
            and not any(key in out for key in _COMBINING) and set(out.get("required") or []) <= set(properties)):
        out["additionalProperties"] = False
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(value, combined, f"{key}/{name}" in combined) for name, value in out[key].items()}
    for key in ("properties", "patternProperties", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(value, combined, False) for name, value in out[key].items()}
    for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):  # (a list of items: draft 4's tuple)
        if isinstance(out.get(key), list):  # a member combining with its siblings or its parent's keys: left open
            out[key] = [_closed(value, combined, _combines(out, key, open_here)) for value in out[key]]
    for key in ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "if", "then", "else", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], combined, key in ("if", "then", "else", "not"))
    return out


def _combined_definitions(schema: Any, combining: bool = False) -> set[str]:
    """The definitions (``$defs/Name``) a reference brings into a combination: they stay open as its members do."""
    found: set[str] = set()
    if isinstance(schema, list):
        for item in schema:
            found |= _combined_definitions(item, combining)
    elif isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and (combining or set(schema) & _COMBINED_WITH):
            found.add(ref[2:])
        for key, value in schema.items():
            found |= _combined_definitions(value, combining or _combines(schema, key, combining))
    return found


def _combines(schema: dict, key: str, open_here: bool = False) -> bool:
    """Whether the members under ``key`` combine with more than themselves: allOf's always; anyOf's and oneOf's where
    their schema combines itself (``open_here``) or something stands beside them (object keys, another combination, a
    reference); alone, each member is a whole value."""
    return key == "allOf" or key in ("anyOf", "oneOf") and (
        open_here or any(name in schema for name in _BESIDE_ALTERNATIVES if name != key))


def _with_their_alternatives(schema: Any, combined: set[str]) -> set[str]:
    """``combined`` and, until nothing is added, what the anyOf/oneOf members of a combined definition reference (an
    allOf over a reference to ``Pet = anyOf[Cat, Dog]``: Cat and Dog combine with the allOf's other members)."""
    if not isinstance(schema, dict):
        return combined
    definitions = {f"{key}/{name}": value for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
                   for name, value in schema[key].items()}
    found, todo = set(combined), list(combined)
    while todo:
        body = definitions.get(todo.pop())
        members = [m for key in ("anyOf", "oneOf") for m in (body.get(key) or [] if isinstance(body, dict) else [])]
        for reference in _combined_definitions(members, combining=True) - found:
            found.add(reference)
            todo.append(reference)
    return found


def tools_schema(parameters: list[tuple[str, dict]], parallel: bool) -> dict:
    """The schema of ``required``'s output: a list of ``{"name", "arguments"}`` calls (``call_schema``)."""
    one = call_schema(parameters)
    calls = one.pop("anyOf")
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1}), **one}


def call_schema(parameters: list[tuple[str, dict]]) -> dict:
    """The schema of one ``{"name", "arguments"}`` call of any of the tools, each tool's parameters under the root's
    ``$defs`` with its definitions beside them: shared by name where the tools agree on them (one copy to compile);
    else each tool's under names of its own (``tool-<i>-defs-<name>``, ``tool-<i>-definitions-<name>``), where two
    tools define one name differently, or one pydantic model is closed differently by its use in each."""
    try:
        return _call_schema(parameters, separate=False)
    except _Clash:
        return _call_schema(parameters, separate=True)


class _Clash(Exception):
    """Two tools define one name differently."""


def _call_schema(parameters: list[tuple[str, dict]], separate: bool) -> dict:
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    calls = []
    for i, (name, schema) in enumerate(parameters):
        own = f"tool-{i}-parameters"
        body = _rerooted(dict(schema), own, f"tool-{i}-" if separate else None)
        for key in ("$defs", "definitions"):
            given = body.pop(key, None) or {}
            if not isinstance(given, dict):
                raise APIError(400, f"a tool's parameters' {key} must be an object of named schemas", param=f"tools[{i}]")
            for defined, value in given.items():
                at, named = ("$defs", f"tool-{i}-{key.lstrip('$')}-{defined}") if separate else (key, defined)
                if defs[at].setdefault(named, value) != value:
                    raise _Clash
        defs["$defs"][own] = body
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{own}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": calls, **{key: value for key, value in defs.items() if value}}


def _rerooted(value: Any, own: str, prefix: str | None) -> Any:
    """References into a tool's own root (``#``, ``#/properties/...``) pointed at where its parameters now live;
    those into its definitions at the names they move to (``prefix`` + ``defs-`` or ``definitions-`` + the name;
    ``prefix`` None: their own, at the root)."""
    if isinstance(value, list):
        return [_rerooted(item, own, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rerooted(item, own, prefix) for key, item in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for key in ("$defs", "definitions"):
            if ref.startswith(f"#/{key}/"):
                if prefix is None:
                    return out
                out["$ref"] = f"#/$defs/{prefix}{key.lstrip('$')}-" + ref[len(f"#/{key}/"):]
                return out
        out["$ref"] = f"#/$defs/{own}" + ref[1:]
    return out
