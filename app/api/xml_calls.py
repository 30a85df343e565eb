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

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
# a parameter ends at its closing tag, or where the next one or the function's end begins (a model may leave it out)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_TEXT_TYPES = ("string", "str", "text")


def read_xml_calls(text: str) -> tuple[str, list[tuple[str, dict[str, str]]]]:
    """The text outside the calls, and each call's function name with its parameters' raw values."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        calls.append((match.group(1).strip(), {name.strip(): value for name, value in _PARAMETER.findall(match.group(2))}))
        kept.append(text[last:match.start()])
        last = match.end()
    return "".join(kept) + text[last:], calls


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
