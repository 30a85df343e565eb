"""Mistral's tool calls after its ``[TOOL_CALLS]`` marker, read as they are written (as ``call_readers``' readers).

Mistral's tokenizers before v11 write one JSON list, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
from v11 on (Mistral Small 3.2, Magistral, Devstral, Ministral 3) each call is ``name[ARGS]{...}`` after a marker of
its own, ``[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}``, with ``[CALL_ID]<id>`` before ``[ARGS]`` in some, and
``name{...}`` without ``[ARGS]`` where a model leaves it out (vLLM reads the same three). ``MistralReader`` takes the
text after the first marker and reads it in whichever form it opens with.
"""

from __future__ import annotations

import regex

from app.api.call_readers import ListReader, _CallsReading, marker_start_held
from app.api.growing import grow_attribute

MISTRAL_MARKER = "[TOOL_CALLS]"
# A call's head up to its arguments' first character: its name, an id or not, then [ARGS] (or the arguments' brace)
_HEAD = regex.compile(r"\s*([A-Za-z0-9_.:\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]*\s*)?(?:\[ARGS\]\s*)?(?=\{)")


class CompactReader(_CallsReading):
    """v11's ``name[ARGS]{...}`` calls, each after its own marker (the first marker already read), as far as they have
    come: ``calls``, ``end`` (where the last call ended: what follows is content) and ``stopped`` (where text that is
    no call began), as ``ListReader``'s."""

    def __init__(self) -> None:
        super().__init__("head")  # head | arguments | tail | done
        self.end: int | None = None
        self.stopped: int | None = None
        self._marker_at: int | None = None  # where the marker before the head being read began (the first: not here)

    def feed(self, delta: str) -> None:
        grow_attribute(self, "text", delta)
        steps = {"head": self._read_head, "arguments": self._read_arguments, "tail": self._read_tail, "done": lambda: False}
        while steps[self._state]():
            pass

    def _read_head(self) -> bool:
        head = _HEAD.match(self.text, self._at, partial=True)
        if head is not None and (head.partial or head.end() == len(self.text)):
            return False  # may still become a head, or the arguments' brace is still to come
        if head is None:  # no call in the format: the text from its marker on stays content
            self._state, self.stopped = "done", self._at if self._marker_at is None else self._marker_at
            return True
        self._begin_call(head.group(1), head.end())
        return True

    def _read_tail(self) -> bool:
        rest = self.text[self._at:].lstrip()
        if rest.startswith(MISTRAL_MARKER):  # the next call
            self._marker_at = len(self.text) - len(rest)
            self._at, self._state = self._marker_at + len(MISTRAL_MARKER), "head"
            return True
        if not rest or marker_start_held(rest, MISTRAL_MARKER) == len(rest):
            return False  # whitespace, or what may begin the next marker
        self.end, self._state = self._at, "done"
        return True


class MistralReader:
    """The text after Mistral's first ``[TOOL_CALLS]``, read as a JSON list or as v11's calls, whichever it opens as."""

    def __init__(self) -> None:
        self._held = ""
        self._reader: ListReader | CompactReader | None = None

    def feed(self, delta: str) -> None:
        if self._reader is None:
            self._held += delta
            body = self._held.lstrip()
            if not body:
                return
            self._reader, delta = (ListReader() if body[0] == "[" else CompactReader()), self._held
        self._reader.feed(delta)

    @property
    def compact(self) -> bool:
        return isinstance(self._reader, CompactReader)

    @property
    def calls(self) -> list[list[str]]:
        return self._reader.calls if self._reader is not None else []

    @property
    def end(self) -> int | None:
        return self._reader.end if self._reader is not None else None

    @property
    def stopped(self) -> int | None:
        return self._reader.stopped if self._reader is not None else None
