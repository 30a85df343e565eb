"""OpenAI's deprecated function calling (``functions``, ``function_call``), which OpenAI still serves and older clients
still send, read as the tool calling it became (app/api/tools.py) and answered in its own shape.

- A request: ``functions`` are tools, ``function_call`` (``"none"``, ``"auto"``, ``{"name"}``) the tool choice, and one
  call at most (the API returns one ``function_call``).
- A transcript, with functions or tools: an assistant message's ``function_call`` is its one tool call, and a
  ``function`` message (its ``name`` and the result) answers the latest call of that name.
- An answer to ``functions``: the message's ``function_call`` (``name``, ``arguments``) with ``finish_reason``
  ``"function_call"``; streamed, each delta's ``function_call`` fragment.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from app.api.errors import APIError


def translated_request(data: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The request body with functions as tools and the transcript's legacy messages as tool messages; and whether the
    answer takes the legacy shape (``functions`` were given)."""
    data = {**data, "messages": translated_messages(data["messages"])} if isinstance(data.get("messages"), list) else dict(data)
    functions, choice = data.pop("functions", None), data.pop("function_call", None)  # null: not given
    if functions is None and choice is None:
        return data, False
    if data.get("tools") is not None or data.get("tool_choice") is not None:
        raise APIError(400, "give tools and tool_choice, or the deprecated functions and function_call, not both",
                       param="functions")
    if not isinstance(functions, list) or not functions or not all(isinstance(f, dict) and f.get("name") for f in functions):
        raise APIError(400, "functions must be a list of {\"name\", \"description\", \"parameters\"} (function_call "
                       "needs it)", param="functions")
    if choice is not None and choice not in ("none", "auto") and not (isinstance(choice, dict) and set(choice) == {"name"}):
        raise APIError(400, "function_call must be \"none\", \"auto\" or {\"name\": ...}", param="function_call")
    data["tools"] = [{"type": "function", "function": function} for function in functions]
    if choice is not None:
        data["tool_choice"] = {"type": "function", "function": choice} if isinstance(choice, dict) else choice
    data["parallel_tool_calls"] = False
    return data, True


def translated_messages(messages: list[Any]) -> list[Any]:
    """A transcript's assistant ``function_call`` as its one tool call, a ``function`` message as the tool message
    answering the latest call of its name."""
    calls: list[tuple[str, str]] = []  # (name, id) of each call so far
    translated = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(message.get("function_call"), dict):
            call = message["function_call"]
            call_id = f"call_{i}"
            calls.append((call.get("name"), call_id))
            message = {**{k: v for k, v in message.items() if k != "function_call"},
                       "tool_calls": [{"id": call_id, "type": "function", "function": call}]}
        elif isinstance(message, dict) and message.get("role") == "function":
            name = message.get("name")
            answered = next((call_id for call_name, call_id in reversed(calls) if call_name == name), f"call_{name}")
            message = {**message, "role": "tool", "tool_call_id": answered}
        translated.append(message)
    return translated


def answer(response: dict) -> dict:
    """A chat answer in the legacy shape: its first call as ``function_call``."""
    for choice in response["choices"]:
        message = choice["message"]
        calls = message.pop("tool_calls", None)
        if calls:
            message["function_call"] = dict(calls[0]["function"])
            if choice["finish_reason"] == "tool_calls":
                choice["finish_reason"] = "function_call"
    return response


async def chunks(stream: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """A chat stream in the legacy shape: each call fragment as ``delta.function_call``."""
    async with contextlib.aclosing(stream):  # closed with this stream (a client gone): its requests aborted at once
        async for chunk in stream:
            for choice in chunk["choices"]:
                entries = choice.get("delta", {}).pop("tool_calls", None)
                if entries:
                    function = entries[0].get("function", {})
                    choice["delta"]["function_call"] = {key: function[key] for key in ("name", "arguments") if key in function}
                if choice.get("finish_reason") == "tool_calls":
                    choice["finish_reason"] = "function_call"
            yield chunk
