"""Streamed chat answers with tools, as OpenAI streams them: the content as deltas, each call as ``delta.tool_calls``
entries (its ``index``, ``id`` and name once the name is whole, then its arguments in fragments as they come), then
the finish."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from app.api.call_readers import ListReader
from app.api.tools import StreamedCalls, ToolCall


async def auto_chunks(chunks: AsyncIterator[dict], parser: str, one_call: bool, tools=None) -> AsyncIterator[dict]:
    """One choice of a chat with ``tool_choice: auto``, from its plain chunks: content as it comes, held only where
    a call may begin (``StreamedCalls``); each call as it is written; at the end any content held, then the finish
    (``tool_calls`` where calls ended it). ``one_call``: ``parallel_tool_calls: false`` keeps the first."""
    calls_in, held_logprobs, sent = StreamedCalls(parser, tools), [], []
    async with contextlib.aclosing(chunks):  # closed with this stream (a client gone): its request aborted at once
        async for chunk in chunks:
            choice = chunk["choices"][0]
            held_logprobs += (choice["logprobs"] or {}).get("content") or []  # they go out with the text they are for
            text, calls = calls_in.feed(choice["delta"].get("content") or ""), calls_in.calls
            if choice["finish_reason"] is not None:
                content, whole = calls_in.finish()
                text, calls = text + (content or ""), [(call.name, call.arguments) for call in whole]
            entries = call_entries(calls[:1] if one_call else calls, sent)
            if text:
                logprobs, held_logprobs = ({"content": held_logprobs} if held_logprobs else None), []
                yield {**chunk, "choices": [{**choice, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}]}
            if entries:  # the calls' tokens' logprobs go with them: the stream's add up to the whole answer's
                logprobs, held_logprobs = ({"content": held_logprobs} if held_logprobs else None), []
                yield {**chunk, "choices": [{**choice, "delta": {"tool_calls": entries}, "logprobs": logprobs, "finish_reason": None}]}
            if choice["finish_reason"] is not None:
                finish = "tool_calls" if sent and choice["finish_reason"] == "stop" else choice["finish_reason"]
                logprobs = {"content": held_logprobs} if held_logprobs else None  # tokens of no text (a call's end)
                yield {**chunk, "choices": [{**choice, "delta": {}, "logprobs": logprobs, "finish_reason": finish}]}


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
            text = held + (choice["delta"].get("content") or "")
            text = text if begun else text.lstrip()  # whitespace before the JSON is left out
            fragment = text.rstrip()
            held = text[len(fragment):]  # trailing whitespace waits for what follows it
            begun = begun or bool(fragment)
            if fragment or choice["logprobs"]:
                entry = {"index": 0, "function": {"arguments": fragment}}
                if not opened:  # the first fragment carries the call's id and name
                    entry = {"index": 0, **call.as_openai(), "function": {"name": name, "arguments": fragment}}
                opened = True
                yield {**chunk, "choices": [{**choice, "delta": {"tool_calls": [entry]}, "finish_reason": None}]}
            if choice["finish_reason"] is not None:
                yield {**chunk, "choices": [{**choice, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}


async def required_call_chunks(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """One choice of a chat under ``tool_choice: required``: each call as soon as its name is whole (its ``index``,
    ``id`` and name), then its arguments as they come, as vLLM streams them; the finish is ``tool_calls``."""
    reader, sent = ListReader(), []  # sent[i]: how much of call i's arguments went out
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            choice = chunk["choices"][0]
            reader.feed(choice["delta"].get("content") or "")
            entries = call_entries([(name, arguments) for name, arguments in reader.calls], sent)
            if entries or choice["logprobs"]:
                delta = {"tool_calls": entries} if entries else {}
                yield {**chunk, "choices": [{**choice, "delta": delta, "finish_reason": None}]}
            if choice["finish_reason"] is not None:
                finish = "tool_calls" if sent and choice["finish_reason"] == "stop" else choice["finish_reason"]
                yield {**chunk, "choices": [{**choice, "delta": {}, "logprobs": None, "finish_reason": finish}]}
