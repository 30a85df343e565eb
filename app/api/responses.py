"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request becomes a chat request, its answer
a response object, its chunks the Responses stream's events (``response.created`` ... ``response.completed``).

What a chat request can say, a response request can: ``input`` (text, or items: messages, earlier
``function_call``s and their ``function_call_output``s), ``instructions`` (a system message first), sampling,
``max_output_tokens``, function ``tools`` with ``tool_choice`` and ``parallel_tool_calls``, and ``text.format``
(structured outputs). This server keeps no responses (``store`` is false whatever is asked): a conversation goes
back as ``input`` each time, and ``previous_response_id`` is a 400 saying so. Other features are a 400 naming them.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any, AsyncIterator

from app.api.errors import APIError

# Fields taken as they are or translated below; taken unset (null, empty) and ignored otherwise
_PASSED = ("model", "temperature", "top_p", "user", "parallel_tool_calls", "stream")
_IGNORED = ("metadata", "store", "truncation", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options")
_UNSET_ONLY = ("previous_response_id", "conversation", "background", "include", "reasoning", "prompt", "max_tool_calls",
               "top_logprobs")
_TRANSLATED = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "text")
_WHY_UNSET = {"previous_response_id": "this server keeps no responses: send the conversation as input",
              "conversation": "this server keeps no conversations: send the conversation as input"}


def chat_body(body: Any) -> dict:
    """The chat request a response request asks for (a 400 naming what cannot be translated)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key in body:
        if key not in _PASSED + _IGNORED + _UNSET_ONLY + _TRANSLATED:
            raise APIError(400, f"unknown field {key!r}", param=key)
    for key in _UNSET_ONLY:
        if body.get(key) not in (None, False, [], {}) and not (key == "top_logprobs" and body[key] == 0):
            raise APIError(400, f"{key} is not supported: {_WHY_UNSET.get(key, 'leave it unset')}", param=key)
    chat = {key: body[key] for key in _PASSED if body.get(key) is not None}
    chat["messages"] = _messages(body.get("instructions"), body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(_listed(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return chat


def _listed(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise APIError(400, f"{param} must be a list", param=param)
    return value


def _messages(instructions: Any, given: Any) -> list[dict]:
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", param="instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    for i, item in enumerate(_listed(given, "input")):
        message = _message(item, f"input[{i}]", messages)
        if message is not None:
            messages.append(message)
    if not messages:
        raise APIError(400, "input must hold at least one message", param="input")
    return messages


def _message(item: Any, param: str, messages: list[dict]) -> dict | None:
    """The chat message of one input item (None where it joins the message before it: consecutive calls)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{param} must be an object (a message or a function call item)", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"{param}.role must be user, system, developer or assistant", param=f"{param}.role")
        return {"role": item["role"], "content": _text(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        previous = messages[-1] if messages else None
        if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls") and not previous["content"]:
            previous["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, f"{param}.output")}
    raise APIError(400, f"{param}.type {kind!r} is not supported (message, function_call, function_call_output)",
                   param=f"{param}.type")


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined (input_text, output_text)."""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(_listed(content, param)):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}[{i}] of type {kind!r} is not supported: text parts only", param=f"{param}[{i}]")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _chat_tool(tool: Any, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools[{index}] of type {kind!r} is not supported: function tools only", param=f"tools[{index}]")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required"; anything else the chat request refuses, naming it


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or not isinstance(text.get("format"), (dict, type(None))):
        raise APIError(400, "text must be {\"format\": {\"type\": ...}}", param="text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format.type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                   param="text.format.type")


# ---- the answer ---------------------------------------------------------------------------------
def new_ids() -> tuple[str, int]:
    return f"resp_{uuid.uuid4().hex}", int(time.time())


def response_object(body: dict, chat: dict, response_id: str, created: int) -> dict:
    """The response for a chat answer (one choice)."""
    choice = chat["choices"][0]
    message, items = choice["message"], []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    if message.get("content"):
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], status))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"], call["function"]["arguments"]))
    return _response(body, response_id, created, chat["model"], status, items, _usage(chat.get("usage")))


def _response(body: dict, response_id: str, created: int, model: str, status: str, output: list, usage: dict | None) -> dict:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": None, "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "truncation": "disabled", "metadata": body.get("metadata") or {},
        "user": body.get("user"), "usage": usage,
    }


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


# ---- the stream -----------------------------------------------------------------------------------
async def response_events(body: dict, chunks: AsyncIterator[dict], response_id: str, created: int) -> AsyncIterator[dict]:
    """The Responses stream's events for a chat stream's chunks: the response created, each output item added, its
    text or arguments as deltas, each item done, then the response completed (``incomplete`` when cut short by
    ``max_output_tokens``) with every item and the usage."""
    stream = _ResponseStream(body, response_id, created)
    first = True
    async for chunk in chunks:
        if first:
            first = False
            for event in stream.begin(chunk["model"]):
                yield event
        for event in stream.take(chunk):
            yield event
    for event in stream.end():
        yield event


class _ResponseStream:
    """The state of one streamed response: its output items in the order they began."""

    def __init__(self, body: dict, response_id: str, created: int) -> None:
        self.body, self.id, self.created = body, response_id, created
        self.model, self.items, self.usage, self.finish = "", [], None, None
        self.text_item: dict | None = None  # the message item taking text, once text came
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its output item
        self.sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _snapshot(self, status: str) -> dict:
        return _response(self.body, self.id, self.created, self.model, status, copy.deepcopy(self.items), self.usage)

    def begin(self, model: str) -> list[dict]:
        self.model = model
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def take(self, chunk: dict) -> list[dict]:
        events = []
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for entry in delta.get("tool_calls") or []:
                events += self._call(entry)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.text_item is None:
            self.text_item = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
            self.items.append(self.text_item)
            added = {**self.text_item, "content": []}  # a copy: the item grows as text comes
            events += [self._event("response.output_item.added", output_index=len(self.items) - 1, item=added),
                       self._event("response.content_part.added", item_id=self.text_item["id"], output_index=len(self.items) - 1,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        self.text_item["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=self.text_item["id"], output_index=self._index(self.text_item),
                                     content_index=0, delta=text, logprobs=[])]

    def _call(self, entry: dict) -> list[dict]:
        events, function = [], entry.get("function") or {}
        item = self.calls.get(entry["index"])
        if item is None:
            item = _call_item(f"fc_{uuid.uuid4().hex}", entry.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                              function.get("name") or "", "", status="in_progress")
            self.calls[entry["index"]] = item
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(item), delta=function["arguments"]))
        return events

    def _index(self, item: dict) -> int:
        return next(i for i, known in enumerate(self.items) if known is item)

    def end(self) -> list[dict]:
        status = "incomplete" if self.finish == "length" else "completed"
        events = []
        for index, item in enumerate(self.items):
            item["status"] = status if item["type"] == "message" else "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                       text=part["text"], logprobs=[]),
                           self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                       part=dict(part))]
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                          name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self._snapshot(status))]


def parse_request(raw: bytes) -> tuple[dict, Any]:
    """A response request's body and the chat request it asks for (400s as the chat endpoints give them)."""
    from app.api.protocol import ChatCompletionRequest, parse_body

    try:
        body = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    return body, parse_body(chat_body(body), ChatCompletionRequest)
