"""The Responses API's stream (``POST /v1/responses`` with ``stream: true``) from a chat stream's chunks: the
response created, each output item added, its text or arguments as deltas and the item done before the next is
added, then the response completed; the event shapes are the openai SDK's (app/api/responses.py makes the items)."""

from __future__ import annotations

import contextlib
import copy
import logging
import uuid
from typing import AsyncIterator

from app.api.errors import APIError, to_api_error
from app.api.growing import grow_item
from app.api.responses import (call_item, logprobs_of, message_item, named_for_responses, reasoning_item, response_dict,
                               usage_of)

logger = logging.getLogger(__name__)


async def response_events(body: dict, chunks: AsyncIterator[dict], response_id: str, created: int,
                          request_id: str | None = None) -> AsyncIterator[dict]:
    """The Responses stream's events for a chat stream's chunks: the response created, each output item added, its
    text or arguments as deltas and the item done before the next begins, then the response completed
    (``incomplete`` when cut short by ``max_output_tokens``) with every item and the usage. A failure after the
    first event is an ``error`` event, then ``response.failed``."""
    stream = _ResponseStream(body, response_id, created)
    try:
        async for chunk in chunks:
            for event in stream.take(chunk):
                yield event
    except Exception as exc:  # noqa: BLE001 - told in the stream: its headers are sent
        named_for_responses(exc)
        if not stream.sequence:
            raise  # nothing sent yet: the request's own HTTP error
        error = to_api_error(exc, request_id)
        if error.status >= 500:
            logger.error("request %s failed: %d %s", request_id, error.status, error.code, exc_info=exc)
        for event in stream.fail(error):
            yield event
        return
    for event in stream.end():
        yield event


async def whole_response(body: dict, chunks: AsyncIterator[dict], response_id: str, created: int) -> dict:
    """The response (``stream: false``) read from the chat stream's chunks as the streamed one is, so that the two
    agree item for item: text written after a call is a message item of its own, after the call's item. A failure is
    the request's own HTTP error, named as the response request names its fields."""
    stream = _ResponseStream(body, response_id, created)
    try:
        async with contextlib.aclosing(chunks):  # closed with this request (a client gone): the answer aborted at once
            async for chunk in chunks:
                stream.take(chunk)
    except Exception as exc:  # noqa: BLE001 - renamed, then the request's own error as any other
        named_for_responses(exc)
        raise
    return stream.end()[-1]["response"]


class _ResponseStream:
    """The state of one streamed response: its output items in the order they began, the last one open."""

    def __init__(self, body: dict, response_id: str, created: int) -> None:
        self.body, self.id, self.created = body, response_id, created
        self.model, self.items, self.usage, self.finish = body.get("model") or "", [], None, None
        self.open: dict | None = None  # the item taking text or arguments now
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its output item
        self.held_logprobs: list = []  # of tokens before a message item begins (no text yet, whitespace after a call)
        self.sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _snapshot(self, status: str, error: dict | None = None) -> dict:
        return response_dict(self.body, self.id, self.created, self.model, status, copy.deepcopy(self.items), self.usage, error)

    def _begin(self) -> list[dict]:
        if self.sequence:
            return []
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def take(self, chunk: dict) -> list[dict]:
        self.model = chunk.get("model") or self.model
        events = self._begin()
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):  # a reasoning model's thinking (app/api/reasoning.py): a reasoning item
                self.held_logprobs = []  # of tokens before it (a <think> the answer opened): the thinking's, no text's
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"], logprobs_of(choice.get("logprobs")))
            elif not delta.get("tool_calls") and not delta.get("reasoning"):  # a token of no text of its own
                events += self._textless(logprobs_of(choice.get("logprobs")))
            for entry in delta.get("tool_calls") or []:
                events += self._call(entry)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def _open(self, item: dict) -> list[dict]:
        """``item`` begins (the open one is done first)."""
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if item["type"] in ("message", "reasoning") else dict(item)  # copies: the item grows
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=added))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif item["type"] == "reasoning":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.items) - 1, []
        item["status"] = status if item["type"] in ("message", "function_call") else "completed"  # a cut call: incomplete
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                   part=copy.deepcopy(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                   part=copy.deepcopy(part))]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        return events + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _textless(self, logprobs: list) -> list[dict]:
        """Logprobs of tokens with no text of their own: the open message's (in an empty delta, so the deltas' add up
        to its logprobs), else the next message's; none while the thinking or a call is open (their markers' tokens
        are no output text's)."""
        if self.open is not None and self.open["type"] == "message":
            return self._text("", logprobs) if logprobs else []
        if self.open is None:
            self.held_logprobs += logprobs
        return []

    def _text(self, text: str, logprobs: list) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            logprobs, self.held_logprobs = self.held_logprobs + logprobs, []
            if self.items:  # text after a call: the whitespace between them is no message's, nor its tokens' logprobs
                text = text.lstrip()
                if not text:
                    return []
                logprobs = _tail_writing(logprobs, text)  # the chunk may carry the call's closing markup first
            events += self._open(message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
        part = self.open["content"][0]
        grow_item(part, "text", text)
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                                     content_index=0, delta=text, logprobs=logprobs)]

    def _reasoning(self, text: str) -> list[dict]:
        """The thinking, as a reasoning item's text (its tokens' logprobs are no output text's: none are given)."""
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._open(reasoning_item(f"rs_{uuid.uuid4().hex}", ""))
        part = self.open["content"][0]
        grow_item(part, "text", text)
        return events + [self._event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                                     content_index=0, delta=text)]

    def _call(self, entry: dict) -> list[dict]:
        events, function = [], entry.get("function") or {}
        item = self.calls.get(entry["index"])
        if item is None:
            self.held_logprobs = []  # of the call's opening markup: no output text's
            item = call_item(f"fc_{uuid.uuid4().hex}", entry.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                              function.get("name") or "", "", status="in_progress")
            self.calls[entry["index"]] = item
            events += self._open(item)
        elif function.get("name"):
            item["name"] = function["name"]
        if function.get("arguments"):
            grow_item(item, "arguments", function["arguments"])
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=function["arguments"]))
        return events

    def end(self) -> list[dict]:
        status = "incomplete" if self.finish == "length" else "completed"
        events = self._begin() + self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self._snapshot(status))]

    def fail(self, error: APIError) -> list[dict]:
        """The ``error`` event with the error's own code, then ``response.failed``, whose ``error.code`` is one of the
        few OpenAI's Responses type allows."""
        kind = "invalid_prompt" if error.status < 500 and error.status != 429 else \
            "rate_limit_exceeded" if error.status in (429, 503) else "server_error"
        return [self._event("error", code=error.code or kind, message=error.message, param=error.param),
                self._event("response.failed", response=self._snapshot("failed", {"code": kind, "message": error.message}))]


def _tail_writing(logprobs: list, text: str) -> list:
    """The last of ``logprobs`` whose tokens' bytes make up ``text`` (as many as its UTF-8 length needs); all of them
    where a token's bytes are not known."""
    if any(entry.get("bytes") is None for entry in logprobs):
        return logprobs
    needed, start = len(text.encode()), len(logprobs)
    while start > 0 and needed > 0:
        start -= 1
        needed -= len(logprobs[start]["bytes"])
    return logprobs[start:]
