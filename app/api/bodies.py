"""A request's body read as JSON, before app/api/protocol.py parses it into a request: an object, holding only text a
tokenizer can encode, nested at most ``MAX_NESTING`` deep. Each problem is a 400 naming it."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from app.api.errors import APIError


def json_object(raw: Any) -> dict:
    """A body as a dict: given as one (a handle call), or JSON text or bytes; a 400 if it is no JSON object."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, (str, bytes, bytearray)) and raw is not None:
        raise APIError(400, f"request body must be a JSON object, not {type(raw).__name__}", code="invalid_json")
    try:
        raw = json.loads(raw or b"", parse_constant=_refuse_json_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except (RecursionError, ValueError) as exc:  # nested past the parser's depth; an integer of 4,300+ digits
        raise APIError(400, f"request body cannot be read: {str(exc) or 'nested too deeply'}", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return raw


def _refuse_json_constant(name: str) -> None:
    """Python's json reads NaN and Infinity, which JSON has not: echoed back, they would fail the answer's encoding."""
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity)")


MAX_NESTING = 64  # levels of objects and lists in a body: a schema deeper than this is no schema a model follows


def require_plain_text(body: dict) -> None:
    """Every string is text the tokenizer can encode (JSON's "\\ud800" escape decodes to a lone UTF-16 surrogate,
    which is not), and the body is nested at most MAX_NESTING deep (later steps re-serialize parts of it). One pass,
    in time with the body's size: a 4 MB list of small prompts is walked in a fraction of a second (a field's path is
    written out only for the error)."""
    pending: list[tuple[Any, tuple | None, int]] = [(body, None, 0)]  # (container, its place: (parent's, key), depth)
    while pending:
        value, place, depth = pending.pop()
        if not value or type(value) is list and _scalars_only(value, depth):
            continue  # numbers (token ids: a prompt of thousands, a list of such prompts), booleans, nulls
        items = value.items() if type(value) is dict else enumerate(value)
        if depth >= MAX_NESTING:
            where = _path((place, next(iter(items))[0]))
            raise APIError(400, f"request body is nested more than {MAX_NESTING} levels deep (at {where})",
                           param=where or None, code="invalid_json")
        if type(value) is dict and _SURROGATE.search("".join(k for k in value if type(k) is str)):  # its keys at once
            raise APIError(400, f"a key in {_path(place) or 'the body'} holds a lone UTF-16 surrogate",
                           param=_path(place) or None, code="invalid_text")
        for key, item in items:
            kind = type(item)
            if kind is str:
                if _SURROGATE.search(item):
                    where = _path((place, key))
                    raise APIError(400, f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                                   param=where, code="invalid_text")
            elif kind is dict or kind is list:
                pending.append((item, (place, key), depth + 1))


_SCALARS = frozenset({int, float, bool, type(None)})


def _scalars_only(value: list, depth: int) -> bool:
    """Whether a list holds only scalars, or only lists of scalars, within the nesting bound: nothing to look into,
    seen at C speed (``map``/``chain``), not item by item."""
    kinds = set(map(type, value))
    if kinds == {list} and depth + 2 <= MAX_NESTING:
        return _SCALARS.issuperset(map(type, itertools.chain.from_iterable(value)))
    return _SCALARS.issuperset(kinds) and (not value or depth < MAX_NESTING)


def _path(place: tuple | None) -> str:
    """A field's dotted path ("messages.0.content") from its place: (its container's place, its key)."""
    keys = []
    while place is not None:
        place, key = place
        keys.append(str(key))
    return ".".join(reversed(keys))


_SURROGATE = re.compile("[\ud800-\udfff]")
