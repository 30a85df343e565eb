"""JSON schemas as the output grammar takes them, from what clients send.

- An object schema that lists its ``properties`` takes no others unless it says ``additionalProperties``, as vLLM's
  default grammar backend (xgrammar's strict mode) reads it and as OpenAI's strict mode requires: the JSON Schema
  default would let a model invent keys (a weather tool's arguments grew a ``"weather"`` key). The members of an
  ``allOf`` are left open (their properties combine); an object without ``properties`` stays a free-form object.
- OpenAPI's ``"nullable": true`` (pydantic v1, FastAPI) becomes a type list with ``"null"``.
- ``tool_choice: required`` nests each tool's parameters inside one schema: their ``$defs``/``definitions`` move to
  its root and their references to their own root (``"$ref": "#"``) follow them (``tools_schema``).
"""

from __future__ import annotations

from typing import Any

from app.api.errors import APIError

_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with the rules above applied throughout (a new object; ``schema`` is left as it is)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out.pop("type"), "null"]
        out.pop("nullable")
    if "properties" in out and "additionalProperties" not in out and not in_all_of:
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(value) for name, value in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(value) for value in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(value, in_all_of=True) for value in out["allOf"]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    return out


def tools_schema(parameters: list[tuple[str, dict]], parallel: bool) -> dict:
    """The schema of ``required``'s output: a list of ``{"name", "arguments"}`` calls, each tool's parameters under
    the root's ``$defs`` with its own definitions beside them (a 400 where two tools define one name differently)."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    calls = []
    for i, (name, schema) in enumerate(parameters):
        own = f"tool-{i}-parameters"
        body = _rerooted(dict(schema), own)
        for key in ("$defs", "definitions"):
            for defined, value in (body.pop(key, None) or {}).items():
                if defs[key].setdefault(defined, value) != value:
                    raise APIError(400, f"tools define {key}/{defined} differently; give it one meaning or rename it",
                                   param="tools")
        defs["$defs"][own] = body
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{own}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    root = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return {**root, **{key: value for key, value in defs.items() if value}}


def _rerooted(value: Any, own: str) -> Any:
    """References into a tool's own root (``#``, ``#/properties/...``) pointed at where its parameters now live;
    those into its definitions stay (they move to the root)."""
    if isinstance(value, list):
        return [_rerooted(item, own) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rerooted(item, own) for key, item in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = f"#/$defs/{own}" + ref[1:]
    return out
