"""Tool calls read as they are written, in one pass over the text however it arrives.

One reader serves both forms of an answer. A stream feeds it the text as it comes and sends each call as soon as
its name is whole, then its arguments' text fragment by fragment (as OpenAI and vLLM stream calls); a whole answer
is fed at once. So a stream assembles to the non-streamed message by construction, and a call cut short by
``max_tokens`` is a call in both, its arguments as far as they came (``finish_reason`` "length"). A call's
arguments are the model's own JSON text.

- ``HermesReader``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among content. A block in
  another shape (its keys in another order, arguments given as a string) is read whole once it closes; a block
  that does not read as a call stays content.
- ``ListReader``: a JSON list of ``{"name": ..., "arguments": ...}`` objects (``tool_choice: required``'s output,
  Mistral's calls after ``[TOOL_CALLS]``), or Llama 3's ``{"name": ..., "parameters": ...}`` objects separated by
  ``;``, read up to the first object in another shape.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from app.api.errors import NOT_JSON
from app.api.growing import grow_attribute, grow_item
MARKER, END = "<tool_call>", "</tool_call>"
# A call object's head up to its arguments' first character: the name is whole once this matches
_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_CONTAINER = regex.compile(r"[\[{]")
_BLOCK_TAIL = regex.compile(r"\s*\}\s*</tool_call>")
_LIST_TAIL = regex.compile(r"\s*\}\s*([,\]])")
PYTHON_TAG = "<|python_tag|>"
_SEQUENCE_TAIL = regex.compile(r"\s*\}\s*(;)")  # Llama 3's calls one after the other: `{...}; {...}`
_OBJECT_END = regex.compile(r"\s*\}")


class JsonValueScan:
    """Where a JSON value that starts at a given offset ends, read incrementally as its text grows."""

    def __init__(self, start: int) -> None:
        self.start, self.at = start, start  # the text before ``at`` is read
        self.ended = False
        self._depth, self._in_string, self._escaped = 0, False, False

    def advance(self, text: str) -> int:
        """The value's end (exclusive) if it has ended, else the text's length. A scalar ends before the ``,`` or
        closing bracket after it; an object or array after its own closing bracket."""
        for i in range(self.at, len(text)):
            char = text[i]
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]," and self._depth == 0:
                self.at, self.ended = i, True
                return i
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.at, self.ended = i + 1, True
                    return i + 1
        self.at = len(text)
        return self.at


def _name(head) -> str | None:
    """A head's function name, or None where it does not decode to text (a bad escape, a raw control character)."""
    try:
        name = json.loads(f'"{head.group(1)}"')
    except NOT_JSON:
        return None
    return name if _is_text(name) else None


def marker_start_held(text: str, marker: str) -> int:
    """How many characters at the text's end may begin ``marker``: they wait for what follows them."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class ContentAndBlocks:
    """Content with blocks that open with ``<tool_call>`` (Hermes', Qwen3-Coder's): the text settles as content up
    to a block, or to what may begin one; ``lead``: the content's length where the first block began (content after
    it waits for the end). A subclass reads the block from state ``OPENED`` on."""

    OPENED = ""
    text: str
    _at: int
    _state: str

    def _init_content(self) -> None:
        self.content, self.lead, self._block_start = "", None, 0

    def _read_text(self) -> bool:
        found = self.text.find(MARKER, self._at)
        if found < 0:
            upto = max(self._at, len(self.text) - marker_start_held(self.text, MARKER))
            grow_attribute(self, "content", self.text[self._at:upto])
            self._at = upto
            return False
        self.content += self.text[self._at:found]
        self.lead = len(self.content) if self.lead is None else self.lead
        self._block_start, self._at, self._state = found, found + len(MARKER), self.OPENED
        return True


class _CallsReading:
    """What both readers share: the text so far, the calls found (``[name, arguments text so far]``, in order), and
    a call's arguments read as they come."""

    def __init__(self, state: str) -> None:
        self.text = ""
        self.calls: list[list[str]] = []
        self._at = 0  # the text before this is read
        self._state = state
        self._scan: JsonValueScan | None = None

    def _begin_call(self, name: str, arguments_start: int) -> None:
        self.calls.append([name, ""])
        self._at, self._state, self._scan = arguments_start, "arguments", JsonValueScan(arguments_start)

    def _read_arguments(self) -> bool:
        end = self._scan.advance(self.text)
        grow_item(self.calls[-1], 1, self.text[self._at:end])  # the scan only moves on: what is new since the last piece
        self._at = end
        if not self._scan.ended:
            return False
        self._state = "tail"
        return True


class HermesReader(_CallsReading, ContentAndBlocks):
    """The content and calls of a Hermes answer as far as it has come (``feed``), then whole (``finish``)."""

    OPENED = "head"

    def __init__(self) -> None:
        super().__init__("text")  # text | head | arguments | tail | block
        self._init_content()

    def feed(self, delta: str) -> None:
        grow_attribute(self, "text", delta)
        steps = {"text": self._read_text, "head": self._read_head, "arguments": self._read_arguments,
                 "tail": self._read_tail, "block": self._read_block}
        while steps[self._state]():
            pass

    def finish(self) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, calls) of the whole answer: content stripped where calls were found, as it was otherwise."""
        rest = self.text[self._at:]
        if self._state == "text":
            self.content += rest
        elif self._state in ("head", "block"):  # an unclosed block: a call if it reads as one, else content
            call = _whole_call(self.text[self._block_start + len(MARKER):]) if self._state == "block" else None
            if call is None:
                self.content += self.text[self._block_start:]
            else:
                self.calls.append(list(call))
        elif self._state == "tail" and not END.startswith(rest.strip().removeprefix("}").lstrip()):
            self.content += rest  # text after a call's arguments that closes no block (not its brace and tag cut short)
        self._at, self._state = len(self.text), "text"
        calls = [(name, arguments) for name, arguments in self.calls]
        if not calls:
            return self.text or None, []
        return self.content.strip() or None, calls

    # ---- one step of the reading each; True where it moved on and may take another -------------------
    def _read_head(self) -> bool:
        head = _HEAD.match(self.text, self._at, partial=True)
        if head is not None and (head.partial or head.end() == len(self.text)):
            return False  # may still become a head, or its arguments' first character is still to come
        if head is None or _name(head) is None or not _CONTAINER.match(self.text, head.end()):
            self._state = "block"  # another shape (or no name): read whole once the block closes
            return True
        self._begin_call(_name(head), head.end())
        return True

    def _read_tail(self) -> bool:
        tail = _BLOCK_TAIL.match(self.text, self._at, partial=True)
        if tail is not None and tail.partial:
            return False
        if tail is None:  # more keys after the arguments: the call stands; the block ends at its closing tag
            found = self.text.find(END, self._at)
            if found < 0:
                return False
            self._at = found + len(END)
        else:
            self._at = tail.end()
        self._state = "text"
        return True

    def _read_block(self) -> bool:
        found = self.text.find(END, self._at)
        if found < 0:
            return False
        call = _whole_call(self.text[self._at:found])
        if call is None:  # unreadable: the block stays content
            self.content += self.text[self._block_start:found + len(END)]
        else:
            self.calls.append(list(call))
        self._at, self._state = found + len(END), "text"
        return True


class ListReader(_CallsReading):
    """The calls of a JSON list of ``{"name": ..., "arguments": ...}`` objects as far as it has come: each named
    one with its arguments' text so far, up to the list's end or the first object in another shape. ``llama3``:
    Llama 3's objects instead (``"parameters"``), after ``<|python_tag|>`` or not, separated by ``;``."""

    def __init__(self, llama3: bool = False) -> None:
        super().__init__("open")  # open | head | arguments | tail | done
        self.llama3 = llama3
        self.end: int | None = None  # where the list ended (its "]"; Llama 3: the last object's "}"), once it has
        self.stopped: int | None = None  # where an object in another shape began, if the reading stopped there

    def feed(self, delta: str) -> None:
        grow_attribute(self, "text", delta)
        steps = {"open": self._read_open, "head": self._read_head, "arguments": self._read_arguments,
                 "tail": self._read_tail, "done": lambda: False}
        while steps[self._state]():
            pass

    def _read_open(self) -> bool:
        body = self.text[self._at:].lstrip()
        if self.llama3:
            if PYTHON_TAG.startswith(body):
                return False  # the tag, or its start, or nothing yet
            body = body.removeprefix(PYTHON_TAG).lstrip()
            if not body:
                return False
            self._at, self._state = len(self.text) - len(body), "head" if body[0] == "{" else "done"
            return True
        if not body:
            return False
        self._at, self._state = len(self.text) - len(body) + 1, "head" if body[0] == "[" else "done"
        return True

    def _read_head(self) -> bool:
        head = _HEAD.match(self.text, self._at, partial=True)
        if head is not None and (head.partial or head.end() == len(self.text)):
            return False
        if head is None or _name(head) is None or not _CONTAINER.match(self.text, head.end()):
            self._state, self.stopped = "done", self._at  # another shape (arguments as a string, keys reordered)
            return True
        self._begin_call(_name(head), head.end())
        return True

    def _read_tail(self) -> bool:
        tail = (_SEQUENCE_TAIL if self.llama3 else _LIST_TAIL).match(self.text, self._at, partial=True)
        if tail is not None and tail.partial:
            return False
        if tail is not None and tail.group(1) in ",;":
            self._at, self._state = tail.end(), "head"
            return True
        if tail is not None:  # "]": the list's end
            self.end = tail.end()
        elif self.llama3 and (close := _OBJECT_END.match(self.text, self._at)) is not None:
            self.end = close.end()  # the last call: what follows is content
        self._state = "done"
        return True


def _whole_call(body: str) -> tuple[str, str] | None:
    """A block's JSON read whole: (name, arguments text), or None if it is no call."""
    try:
        value = json.loads(body.strip())
    except NOT_JSON:
        return None
    return call_from(value, ("arguments", "parameters"))


def call_from(value: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments text) of a decoded ``{"name", <the first of keys present>}`` object, or None if it is none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in keys if key in value), {})
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return (value["name"], arguments) if _is_text(value["name"]) and _is_text(arguments) else None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" decodes to no text
        return False
    return True
