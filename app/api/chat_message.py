"""A chat message as a client sends it (OpenAI's shapes, an answer replayed as history included) and as the chat
template sees it."""

from __future__ import annotations

import json
from typing import Any, Literal

from app.api.errors import APIError
from app.api.strict_model import StrictModel


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (app/api/tools.py renders them)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant message of OpenAI's shape replayed as history: output metadata, not shown to the model
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None  # a reference to an earlier audio answer: none is ever given here
    function_call: None = None  # the deprecated form of tool_calls
    # An earlier answer's reasoning, replayed (LiteLLM, the Agents SDK): to the template, which shows it or not
    reasoning_content: str | None = None
    reasoning: str | None = None
    provider_specific_fields: dict[str, Any] | None = None  # LiteLLM's metadata on a replayed message: not shown

    def as_template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [_replayed_call(call, i) for i, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:  # the participant's name, for templates that render it
            message["name"] = self.name
        for field in ("reasoning_content", "reasoning"):  # transformers shows it under each name templates read
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            key = _TEXT_PARTS.get(part.get("type"))
            if key is None or not isinstance(part.get(key), str):
                raise APIError(400, f"only text content parts are supported ({', '.join(_TEXT_PARTS)})", param="messages",
                               code="unsupported_content")
            parts.append(part[key])
        return "\n".join(parts)  # as vLLM joins them: parts are separate pieces of text


# Content parts that are text, and the key holding it: chat's, the Responses API's, and an assistant's refusal replayed
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _replayed_call(call: Any, i: int) -> dict[str, Any]:
    """An earlier tool call as the template sees it: its arguments as JSON text, as OpenAI sends them; an object (as
    some clients send them) as its JSON, none as ``{}``."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, "a tool call needs function.name (and function.arguments, a JSON string)",
                       param=f"messages.tool_calls[{i}]")
    arguments = function.get("arguments")
    if not isinstance(arguments, (str, dict, type(None))):
        raise APIError(400, "a tool call's function.arguments must be a JSON string (or an object)",
                       param=f"messages.tool_calls[{i}].function.arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {})
    return {**call, "function": {**function, "arguments": arguments}}
