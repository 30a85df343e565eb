"""Qwen3-Coder's tool calls: XML-like blocks whose parameters hold raw text, typed by the tool's JSON Schema, as
vLLM's ``qwen3_coder`` parser reads them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import json
import re
from typing import Any

_MARKER, _END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<tool_call>\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?")
# a value ends at its closing tag, or where the next parameter begins (a model may leave the tag out), or with the
# function
_VALUE_END = re.compile(r"\n?(?:</parameter>|(?=<parameter=))")
_TEXT_TYPES = ("string", "str", "text")


def read_xml_calls(text: str) -> tuple[str, list[tuple[str, list[tuple[str, str]], bool]]]:
    """The text outside the calls, and each call as far as it has come: its function name, the parameters whose
    values are whole (raw text), and whether the function is closed. Read again as a stream's text grows: what it
    returns only grows."""
    calls, kept, at = [], [], 0
    while (start := text.find(_MARKER, at)) >= 0:
        kept.append(text[at:start])
        head = _FUNCTION.match(text, start)
        if head is None:  # no function (yet): the block is text
            end = text.find(_END, start)
            kept.append(text[start:] if end < 0 else text[start:end + len(_END)])
            at = len(text) if end < 0 else end + len(_END)
            continue
        close = text.find("</function>", head.end())
        body = text[head.end():] if close < 0 else text[head.end():close]
        calls.append((head.group(1).strip(), _parameters(body, close >= 0), close >= 0))
        if close < 0:
            return "".join(kept), calls
        end = text.find(_END, close)
        at = close + len("</function>") if end < 0 else end + len(_END)
    return "".join(kept) + text[at:], calls


def _parameters(body: str, closed: bool) -> list[tuple[str, str]]:
    """A function's parameters whose values are whole: ended by a tag, or by the function's end once it is closed."""
    found = []
    for opened in _PARAMETER.finditer(body):
        end = _VALUE_END.search(body, opened.end())
        if end is None and not closed:
            break  # still being written
        value = body[opened.end():end.start()] if end is not None else body[opened.end():].removesuffix("\n")
        found.append((opened.group(1).strip(), value))
    return found


def xml_arguments(parameters: list[tuple[str, str]], closed: bool, schema: dict) -> str:
    """A call's arguments as JSON text, as ``json.dumps`` writes the object (closed once the function is): each
    value typed by the tool's schema (``schema``: its ``properties``). Grows by appending as parameters come."""
    pairs = [f"{json.dumps(key)}: {json.dumps(typed(value, schema.get(key)))}" for key, value in parameters]
    return "{" + ", ".join(pairs) + ("}" if closed else "")


def typed(value: str, schema: dict | None) -> Any:
    """A raw value as its parameter's schema types it: text stays text; integers, numbers, booleans, null, objects
    and arrays are read (text where they do not read); a parameter the schema does not name stays text."""
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"  # `true` is a schema too
    kinds = [kind] if isinstance(kind, str) else list(kind)
    if value.strip().lower() == "null" and ("null" in kinds or not any(k in _TEXT_TYPES for k in kinds)):
        return None
    if any(k in _TEXT_TYPES for k in kinds):
        return value
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if "integer" in kinds and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed
