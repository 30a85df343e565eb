"""Streamed chat answers with tools, as OpenAI streams them: the content as deltas, each call as ``delta.tool_calls``
entries (its ``index``, ``id`` and name once the name is whole, then its arguments in fragments as they come), then
the finish."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from app.api.call_readers import PYTHON_TAG, HermesReader, ListReader, marker_start_held
from app.api.growing import grow_attribute
from app.api.mistral_calls import MISTRAL_MARKER, MistralReader
from app.api.tools import TOOL_PARSERS, Tool, ToolCall, parse_calls, schemas_of, whole_arguments
from app.api.xml_calls import XmlReader


async def auto_chunks(chunks: AsyncIterator[dict], parser: str, one_call: bool, tools=None) -> AsyncIterator[dict]:
    """One choice of a chat with ``tool_choice: auto``, from its plain chunks: content as it comes, held only where
    a call may begin (``StreamedCalls``); each call as it is written; at the end any content held, then the finish
    (``tool_calls`` where calls ended it). ``one_call``: ``parallel_tool_calls: false`` keeps the first."""
    calls_in, held_logprobs, sent = StreamedCalls(parser, tools), [], []
    async with contextlib.aclosing(chunks):  # closed with this stream (a client gone): its request aborted at once
        async for chunk in chunks:
            choice = chunk["choices"][0]
            held_logprobs += (choice["logprobs"] or {}).get("content") or []  # they go out with the text they are for
            if choice["delta"].get("reasoning"):
                logprobs, held_logprobs = ({"content": held_logprobs} if held_logprobs else None), []
                yield thinking_chunk(chunk, choice, logprobs)
            text, calls = calls_in.feed(choice["delta"].get("content") or ""), calls_in.calls
            if choice["finish_reason"] is not None:
                content, whole = calls_in.finish()
                text, calls = text + (content or ""), [(call.name, call.arguments) for call in whole]
            calls = calls[:1] if one_call else calls  # (the finish reads the kept calls alone, as the whole answer does)
            entries = call_entries(calls, sent)
            if not (text or entries or choice["finish_reason"] is not None or choice["delta"].get("reasoning")):
                yield held_back(chunk, choice)
            if text:
                logprobs, held_logprobs = ({"content": held_logprobs} if held_logprobs else None), []
                yield {**chunk, "choices": [{**pending(choice), "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}]}
            if entries:  # the calls' tokens' logprobs go with them: the stream's add up to the whole answer's
                logprobs, held_logprobs = ({"content": held_logprobs} if held_logprobs else None), []
                yield {**chunk, "choices": [{**pending(choice), "delta": {"tool_calls": entries}, "logprobs": logprobs, "finish_reason": None}]}
            if choice["finish_reason"] is not None:  # "tool_calls" unless a stop string ended it inside a call
                whole_calls = sent and whole_arguments([ToolCall(name, arguments) for name, arguments in calls])
                finish = "tool_calls" if whole_calls and choice["finish_reason"] == "stop" else choice["finish_reason"]
                logprobs = {"content": held_logprobs} if held_logprobs else None  # tokens of no text (a call's end)
                yield {**chunk, "choices": [{**choice, "delta": {}, "logprobs": logprobs, "finish_reason": finish}]}


def held_back(chunk: dict, choice: dict) -> dict:
    """A token whose text is held (a call may begin there, or thinking not shown) as an empty chunk: a stream sends a
    chunk for each token, so its first byte never waits for a hidden thinking's end (a proxy's idle timeout would cut
    it), and its logprobs go out with the text they are for."""
    return {**chunk, "choices": [{**pending(choice), "delta": {}, "logprobs": None, "finish_reason": None}]}


def pending(choice: dict) -> dict:
    """``choice`` for a chunk that does not finish it: without the finishing output's ``stop_reason``."""
    return {key: value for key, value in choice.items() if key != "stop_reason"}


def thinking_chunk(chunk: dict, choice: dict, logprobs: dict | None) -> dict:
    """A reasoning model's thinking in ``choice``'s delta (app/api/reasoning.py), as a chunk of its own: it goes out as
    it comes, before any call."""
    thought = {key: choice["delta"][key] for key in ("reasoning", "reasoning_content")}
    return {**chunk, "choices": [{**pending(choice), "delta": thought, "logprobs": logprobs, "finish_reason": None}]}


def call_entries(calls: list[tuple[str, str]], sent: list[int]) -> list[dict]:
    """``delta.tool_calls`` entries for what of ``calls`` (name, arguments so far) has not gone out: a new call's
    index, id, name and arguments so far; an earlier one's further arguments. ``sent[i]``: how much of call i's
    arguments went out (updated)."""
    entries = []
    for i, (name, arguments) in enumerate(calls):
        if i == len(sent):
            entries.append({"index": i, **ToolCall(name, "").as_openai(), "function": {"name": name, "arguments": arguments}})
            sent.append(len(arguments))
        elif len(arguments) > sent[i]:
            entries.append({"index": i, "function": {"arguments": arguments[sent[i]:]}})
            sent[i] = len(arguments)
    return entries


async def named_call_chunks(chunks: AsyncIterator[dict], name: str) -> AsyncIterator[dict]:
    """One choice of a chat whose ``tool_choice`` names a function: the answer is the call's arguments (constrained
    to its schema), streamed as they come, as vLLM streams them: the call's id, name and first fragment, then each
    fragment, then the finish. Whitespace around the JSON is left out, as the non-streamed call's arguments are."""
    call, held, opened, begun = ToolCall(name, ""), "", False, False
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            choice = chunk["choices"][0]
            if choice["delta"].get("reasoning"):  # the call comes after the thinking
                yield thinking_chunk(chunk, choice, choice["logprobs"])
                choice = {**choice, "logprobs": None}
            text = held + (choice["delta"].get("content") or "")
            text = text if begun else text.lstrip()  # whitespace before the JSON is left out
            fragment = text.rstrip()
            held = text[len(fragment):]  # trailing whitespace waits for what follows it
            begun = begun or bool(fragment)
            if not (fragment or choice["logprobs"] or choice["finish_reason"] is not None or choice["delta"].get("reasoning")):
                yield held_back(chunk, choice)
            if fragment or choice["logprobs"]:
                entry = {"index": 0, "function": {"arguments": fragment}}
                if not opened:  # the first fragment carries the call's id and name
                    entry = {"index": 0, **call.as_openai(), "function": {"name": name, "arguments": fragment}}
                opened = True
                yield {**chunk, "choices": [{**pending(choice), "delta": {"tool_calls": [entry]}, "finish_reason": None}]}
            if choice["finish_reason"] is not None:
                yield {**chunk, "choices": [{**choice, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}


async def required_call_chunks(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """One choice of a chat under ``tool_choice: required``: each call as soon as its name is whole (its ``index``,
    ``id`` and name), then its arguments as they come, as vLLM streams them; the finish is ``tool_calls``. An answer cut
    short before its first call's name is whole is content at the finish, as the non-streamed message has it."""
    reader, sent, text = ListReader(), [], ""  # sent[i]: how much of call i's arguments went out
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            choice = chunk["choices"][0]
            if choice["delta"].get("reasoning"):  # the calls come after the thinking
                yield thinking_chunk(chunk, choice, choice["logprobs"])
                choice = {**choice, "logprobs": None}
            piece = choice["delta"].get("content") or ""
            text += piece
            reader.feed(piece)
            entries = call_entries([(name, arguments) for name, arguments in reader.calls], sent)
            if entries or choice["logprobs"] or (choice["finish_reason"] is None and not choice["delta"].get("reasoning")):
                delta = {"tool_calls": entries} if entries else {}
                yield {**chunk, "choices": [{**pending(choice), "delta": delta, "finish_reason": None}]}
            if choice["finish_reason"] is not None:  # "tool_calls" unless a stop string ended it inside a call
                whole_calls = sent and whole_arguments([ToolCall(name, arguments) for name, arguments in reader.calls])
                finish = "tool_calls" if whole_calls and choice["finish_reason"] == "stop" else choice["finish_reason"]
                delta = {"content": text} if text and not sent else {}
                yield {**chunk, "choices": [{**choice, "delta": delta, "logprobs": None, "finish_reason": finish}]}


_CALL_MARKERS = {"mistral": MISTRAL_MARKER}  # Hermes, Qwen3-Coder: their readers


class StreamedCalls:
    """A free answer (``tool_choice: auto``) as it streams: content goes out as it comes, up to where a call may
    begin (the parser's marker, or the start of one at the end of the text so far; for ``llama3_json``, an answer
    that opens as JSON). Calls go out as they are written (``calls``: read as whole answers are, so a stream
    assembles to the whole answer)."""

    def __init__(self, parser: str, tools: list[Tool] | None = None) -> None:
        if parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {parser!r} (known: {', '.join(TOOL_PARSERS)})")
        self.parser, self.tools = parser, tools
        self.text = ""
        self.released = 0  # the text before this has gone out as content
        # Hermes and Qwen3-Coder: content and calls read in one (content after the first call waits for the end)
        self._reader = HermesReader() if parser == "hermes" else XmlReader(schemas_of(tools)) if parser == "qwen3_coder" else None
        self._list = ListReader(llama3=True) if parser == "llama3_json" else None  # Mistral's: from its marker on

    @property
    def calls(self) -> list[tuple[str, str]]:
        """The calls written so far, each one's name and arguments as far as they came."""
        if self._reader is not None:
            return [(name, arguments) for name, arguments in self._reader.calls]
        if self._list is not None:
            return [(name, arguments) for name, arguments in self._list.calls]
        return []

    def feed(self, delta: str) -> str:
        """Add the answer's next text; returns the content that can go out now. Trailing whitespace waits for what
        follows it: before a call it is no content (the whole answer's content is stripped there)."""
        grow_attribute(self, "text", delta)
        if self._reader is not None:  # content before the first call, the text's start (after it: held to the end)
            self._reader.feed(delta)
            upto = self._reader.lead if self._reader.lead is not None else len(self._reader.content)
        else:
            self._feed_list(delta)
            upto = self._releasable()
        while upto > self.released and self.text[upto - 1].isspace():  # not a copy of the text at every piece
            upto -= 1
        upto = max(upto, self.released)
        out, self.released = self.text[self.released:upto], upto
        return out

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """The content not sent yet (None if none) and every call: the whole answer's, less what went out."""
        if self._reader is not None:
            content, found = self._reader.finish()
            calls = [ToolCall(name, arguments) for name, arguments in found]
        else:
            content, calls = parse_calls(self.text, self.parser, self.tools)
        sent = self.text[:self.released]  # the content stripped where calls were found: so is what went out of it
        rest = content[len(sent) if content.startswith(sent) else len(sent.lstrip()):] if content is not None else None
        return rest or None, calls

    def _feed_list(self, delta: str) -> None:
        if self._list is not None:
            self._list.feed(delta)
        elif self.parser == "mistral" and MISTRAL_MARKER in self.text:
            self._list = MistralReader()
            self._list.feed(self.text.partition(MISTRAL_MARKER)[2])

    def _releasable(self) -> int:
        text = self.text
        if self.parser == "llama3_json":  # calls only where the answer opens with one: JSON or the tag
            body = text.lstrip()
            opens_as_call = body.startswith("{") or body.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(body)
            return 0 if not body or opens_as_call else len(text)
        marker = _CALL_MARKERS[self.parser]
        found = text.find(marker, self.released)
        if found >= 0:
            return found
        return len(text) - marker_start_held(text, marker)
