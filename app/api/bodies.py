"""A request's body read as JSON, before app/api/protocol.py parses it into a request: an object, holding only text a
tokenizer can encode, nested at most ``MAX_NESTING`` deep. Each problem is a 400 naming it."""

from __future__ import annotations

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
    which is not), and the body is nested at most MAX_NESTING deep (later steps re-serialize parts of it)."""
    pending: list[tuple[Any, str, int]] = [(body, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_NESTING:
            raise APIError(400, f"request body is nested more than {MAX_NESTING} levels deep (at {path})",
                           param=path or None, code="invalid_json")
        if isinstance(value, str) and _SURROGATE.search(value):
            raise APIError(400, f"{path or 'the body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                           param=path or None, code="invalid_text")
        if isinstance(value, list) and all(type(item) is int for item in value):
            continue  # token ids: nothing to look into (a prompt of thousands)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise APIError(400, f"a key in {path or 'the body'} holds a lone UTF-16 surrogate", param=path or None,
                               code="invalid_text")
            pending.append((item, f"{path}.{key}" if path else str(key), depth + 1))


_SURROGATE = re.compile("[\ud800-\udfff]")
