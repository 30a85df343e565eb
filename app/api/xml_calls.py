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
from typing import Any

import regex

from app.api.call_readers import ContentAndBlocks
from app.api.errors import NOT_JSON
from app.api.growing import grow_attribute

_MARKER, _END, _FUNCTION_END, _PARAMETER_END = "<tool_call>", "</tool_call>", "</function>", "</parameter>"
_FUNCTION = regex.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = regex.compile(r"<parameter=([^>\n]+)>\n?")
_PARAMETER_OPEN = "<parameter="
_TEXT_TYPES = ("string", "str", "text")


class XmlReader(ContentAndBlocks):
    """Qwen3-Coder's content and calls as far as they have come (``feed``), then whole (``finish``), in one pass.

    Each call's arguments are the JSON text of its typed parameters so far: ``{`` once its name is whole, then
    ``"key": value`` as each value is (ended by its closing tag, the next parameter or the function's end; one
    newline around it is the format's), ``}`` as the function closes: a stream's fragments join to the object
    ``json.dumps`` writes. A parameter cut short is left out; a call cut short is a call as far as it came. A block
    with no function is text. ``schemas``: each tool's ``properties``, which type the values (``typed``)."""

    OPENED = "function"

    def __init__(self, schemas: dict[str, dict]) -> None:
        self.text = ""
        self._init_content()
        self.calls: list[list[str]] = []  # [name, arguments text so far]
        self._schemas = schemas
        self._at, self._state = 0, "text"  # text | function | skip | parameters | value | after
        self._key, self._value_start, self._pairs = "", 0, 0

    def feed(self, delta: str) -> None:
        grow_attribute(self, "text", delta)
        steps = {"text": self._read_text, "function": self._read_function, "skip": self._read_skip,
                 "parameters": self._read_parameters, "value": self._read_value, "after": self._read_after}
        while steps[self._state]():
            pass

    def finish(self) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, calls) of the whole answer: content stripped where calls were found, as it was otherwise."""
        rest = self.text[self._at:]
        if self._state == "text" or (self._state == "after" and not _END.startswith(rest.strip())):
            self.content += rest
        elif self._state in ("function", "skip"):
            self.content += self.text[self._block_start:]
        self._at, self._state = len(self.text), "text"
        if not self.calls:
            return self.text or None, []
        return self.content.strip() or None, [(name, arguments) for name, arguments in self.calls]

    # ---- one step of the reading each; True where it moved on and may take another -------------------
    def _read_function(self) -> bool:
        head = _FUNCTION.match(self.text, self._at, partial=True)
        if head is not None and head.partial:
            return False
        if head is None:  # no function: the block is text, to its end tag
            self._state = "skip"
            return True
        self.calls.append([head.group(1).strip(), "{"])
        self._at, self._state, self._pairs = head.end(), "parameters", 0
        return True

    def _read_skip(self) -> bool:
        """A block with no function is text, to its end tag or the next block's start."""
        end, following = self.text.find(_END, self._at), self.text.find(_MARKER, self._at)
        if following >= 0 and (end < 0 or following < end):
            self.content += self.text[self._block_start:following]
            self._at, self._state = following, "text"
            return True
        if end < 0:
            self._at = max(self._at, len(self.text) - len(_END))  # what was searched is not searched again
            return False
        self.content += self.text[self._block_start:end + len(_END)]
        self._at, self._state = end + len(_END), "text"
        return True

    def _read_parameters(self) -> bool:
        """Between parameters: the next one opens, or the function closes (text between them is skipped)."""
        opened, closed = self.text.find(_PARAMETER_OPEN, self._at), self.text.find(_FUNCTION_END, self._at)
        if closed >= 0 and (opened < 0 or closed < opened):
            self.calls[-1][1] += "}"
            self._at, self._state = closed + len(_FUNCTION_END), "after"
            return True
        if opened < 0:
            self._at = max(self._at, len(self.text) - len(_FUNCTION_END))  # a tag cut short starts in the last few
            return False
        tag = _PARAMETER.match(self.text, opened, partial=True)
        if tag is not None and (tag.partial or tag.end() == len(self.text)):
            return False  # its name, or whether a newline follows, is still to come
        if tag is None:  # not a tag after all ("<parameter=" then a newline)
            self._at = opened + len(_PARAMETER_OPEN)
            return True
        self._key, self._value_start, self._at, self._state = tag.group(1).strip(), tag.end(), tag.end(), "value"
        return True

    def _read_value(self) -> bool:
        """A value ends at its closing tag, or where the next parameter or the function's end begins."""
        ends = [(i, tag) for tag in (_PARAMETER_END, _PARAMETER_OPEN, _FUNCTION_END) if (i := self.text.find(tag, self._at)) >= 0]
        if not ends:
            self._at = max(self._at, len(self.text) - len(_PARAMETER_END))
            return False
        end, tag = min(ends)
        value = self.text[self._value_start:end].removesuffix("\n")
        name = self.calls[-1][0]
        pair = f"{json.dumps(self._key)}: {json.dumps(typed(value, self._schemas.get(name, {}).get(self._key)))}"
        self.calls[-1][1] += (", " if self._pairs else "") + pair
        self._pairs += 1
        self._at, self._state = (end + len(tag) if tag == _PARAMETER_END else end), "parameters"
        return True

    def _read_after(self) -> bool:
        """After a function: its block's end tag, or (where a model left it out) text."""
        rest = self.text[self._at:].lstrip()
        if rest.startswith(_END):
            self._at, self._state = len(self.text) - len(rest) + len(_END), "text"
            return True
        if _END.startswith(rest):
            return False  # nothing yet, or the tag's start
        self._state = "text"
        return True


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
    except NOT_JSON:
        return value
    if "integer" in kinds and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed
