"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request becomes a streamed chat request,
and its chunks become the response, whole or as the stream's events (app/api/response_stream.py).

What a chat request can say, a response request can: ``input`` (text, or items: messages, earlier
``function_call``s and their ``function_call_output``s), ``instructions`` (a system message first), sampling,
``max_output_tokens``, function ``tools`` with ``tool_choice`` and ``parallel_tool_calls``, and ``text.format``
(structured outputs). This server keeps no responses (``store`` is false whatever is asked): a conversation goes
back as ``input`` each time, and ``previous_response_id`` is a 400 saying so. Other features are a 400 naming them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from app.api.errors import APIError, client_error
from app.api.tools import require_loaded

# Fields taken as they are or translated below; accepted and left without effect; taken unset (null, empty) only
_PASSED = ("model", "temperature", "top_p", "user", "parallel_tool_calls", "stream", "top_k", "min_p", "seed", "stop",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
           # vLLM's Responses extras, as the chat request takes them (request_id is the response's id too, as vLLM's)
           "chat_template_kwargs", "include_reasoning", "skip_special_tokens", "include_stop_str_in_output",
           "stop_token_ids", "cache_salt", "request_id", "priority", "structured_outputs")
# max_tool_calls bounds calls of built-in tools, which are refused here: without effect on function calls
_IGNORED = ("metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "safety_identifier", "stream_options", "max_tool_calls")
_UNSET_ONLY = ("previous_response_id", "conversation", "background", "prompt", "context_management")
_TRANSLATED = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "include", "top_logprobs",
               "reasoning", "truncation")
_WHY_UNSET = {"previous_response_id": "this server keeps no responses: send the conversation as input",
              "conversation": "this server keeps no conversations: send the conversation as input"}
_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = (_LOGPROBS, "reasoning.encrypted_content")  # reasoning items are made in the clear: nothing to encrypt
# The chat request's names in its 400s, as the response request names them
_NAMES = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input"),
          ("verbosity", "text.verbosity"), ("reasoning_effort", "reasoning.effort"))


def chat_body(body: Any) -> dict:
    """The chat request a response request asks for (a 400 naming what cannot be translated)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key in body:
        if key not in _PASSED + _IGNORED + _UNSET_ONLY + _TRANSLATED:
            raise APIError(400, f"unknown field {key!r}", param=key)
    for key in _UNSET_ONLY:
        if body.get(key) not in (None, False, [], {}):
            raise APIError(400, f"{key} is not supported: {_WHY_UNSET.get(key, 'leave it unset')}", param=key)
    effort = _reasoning_effort(body.get("reasoning"))
    if body.get("metadata") is not None and not (isinstance(body["metadata"], dict)
                                                 and all(isinstance(v, str) for v in body["metadata"].values())):
        raise APIError(400, "metadata must map keys to strings", param="metadata")
    calls = body.get("max_tool_calls")
    if calls is not None and (not isinstance(calls, int) or isinstance(calls, bool) or calls < 0):
        raise APIError(400, "max_tool_calls must be a non-negative integer", param="max_tool_calls")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):  # the chat request's is always true
        raise APIError(400, "stream must be true or false", param="stream")
    chat = {key: body[key] for key in _PASSED if body.get(key) is not None}
    chat["messages"] = _messages(body.get("instructions"), body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(_listed(body["tools"], "tools"))]
    if body.get("tool_choice") is not None and (chat.get("tools") or body["tool_choice"] not in ("auto", "none")):
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])  # "auto" without tools: the default, as OpenAI's
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        if body.get("structured_outputs") is not None:
            raise APIError(400, "give text.format or structured_outputs, not both", param="structured_outputs")
        chat["response_format"] = response_format
    if isinstance(body.get("text"), dict) and body["text"].get("verbosity") is not None:
        chat["verbosity"] = body["text"]["verbosity"]  # refused there, as the chat field is
    chat.update(_logprobs(body.get("include"), body.get("top_logprobs")))
    if effort is not None:
        chat["reasoning_effort"] = effort
    # Streamed whether the response is or not: a whole response is read from the stream as a streamed one is
    # (app/api/response_stream.py), so the two hold the same items in the same order; the usage comes last
    chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


_SUMMARIES = (None, "auto", "concise", "detailed")


def _reasoning_effort(reasoning: Any) -> Any:
    """``reasoning.effort``, for the chat template as chat's ``reasoning_effort``. A summary asked for is taken and
    none is written, as vLLM does: a reasoning item carries the whole reasoning as its content instead."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise APIError(400, "reasoning must be an object such as {\"effort\": \"low\"}", param="reasoning")
    for key, value in reasoning.items():
        if key in ("summary", "generate_summary") and value not in _SUMMARIES:
            raise APIError(400, f"reasoning.{key} must be one of auto, concise, detailed", param=f"reasoning.{key}")
        if key not in ("effort", "summary", "generate_summary") and value is not None:
            raise APIError(400, f"reasoning.{key} is not supported (effort, summary)", param=f"reasoning.{key}")
    return reasoning.get("effort")


def _logprobs(include: Any, top: Any) -> dict:
    """The chat request's logprob fields: ``include`` asking for the output text's logprobs, ``top_logprobs``."""
    included = _listed(include, "include") if include is not None else []
    for i, name in enumerate(included):
        if name not in _INCLUDABLE:
            raise APIError(400, f"include[{i}] {name!r} is not supported ({', '.join(_INCLUDABLE)})", param=f"include[{i}]")
    if _LOGPROBS not in included:
        if top:
            raise APIError(400, f"top_logprobs needs include: [{_LOGPROBS!r}]", param="top_logprobs")
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


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
    if given is None:
        raise APIError(400, "input is required: a string or a list of items", param="input")
    for i, item in enumerate(_listed(given, "input")):
        message = _message(item, f"input[{i}]", messages)
        if message is not None:
            messages.append(message)
    if not messages:
        raise APIError(400, "input must hold at least one message", param="input")
    return messages


def _message(item: Any, param: str, messages: list[dict]) -> dict | None:
    """The chat message of one input item; None where it joins the assistant message before it (its thinking, calls
    and text are one turn, however the items split them; a template shows the thinking of the turns it shows it of,
    Qwen3's those after the last user message, an agent loop's steps) or is dropped (a reasoning item of no text)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{param} must be an object (a message or a function call item)", param=param)
    kind = item.get("type", "message")
    previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "message":
        if item.get("role") not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"{param}.role must be user, system, developer or assistant", param=f"{param}.role")
        text = _text(item.get("content"), f"{param}.content")
        if item["role"] == "assistant" and previous is not None and (previous.get("tool_calls") or not previous["content"]):
            previous["content"] = f"{previous['content']}\n\n{text}" if previous["content"] else text  # text after calls too
            return None
        return {"role": item["role"], "content": text}
    if kind in ("function_call", "function_call_output"):
        required = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id",)
        for key in required:  # as OpenAI: named by the item, not by the chat message it becomes
            value = item.get(key)
            if not (isinstance(value, str) or key == "arguments" and isinstance(value, dict)):  # as chat takes it
                missing = f"Missing required parameter: '{param}.{key}'"
                raise APIError(400, f"{param}.{key} must be a string" if key in item else missing, param=f"{param}.{key}")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, f"{param}.output")}
    if kind == "reasoning":  # as vLLM reads it: its text, else its summary's (encrypted content: none made here)
        parts = [part for key in ("content", "summary") for part in (item.get(key) or []) if isinstance(part, dict)]
        thinking = next((part["text"] for part in parts if isinstance(part.get("text"), str) and part["text"]), None)
        return {"role": "assistant", "content": None, "reasoning": thinking} if thinking else None
    raise APIError(400, f"{param}.type {kind!r} is not supported (message, function_call, function_call_output)",
                   param=f"{param}.type")


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or its text parts joined as lines (input_text, output_text)."""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(_listed(content, param)):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}[{i}] of type {kind!r} is not supported: text parts only", param=f"{param}[{i}]")
        text = part.get("refusal" if part["type"] == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{param}[{i}] needs its text as a string", param=f"{param}[{i}]")
        parts.append(text)
    return "\n".join(parts)  # as a chat message's text parts join


def _chat_tool(tool: Any, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools[{index}] of type {kind!r} is not supported: function tools only", param=f"tools[{index}]")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"tools[{index}].name is required: the function's name", param=f"tools[{index}].name")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading"})
    if unknown:  # a misspelt "parameters" would otherwise make a function of no arguments
        raise APIError(400, f"unknown field tools[{index}].{unknown[0]}", param=f"tools[{index}].{unknown[0]}")
    require_loaded(tool.get("defer_loading"), f"tools[{index}].defer_loading")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must name its function: {\"type\": \"function\", \"name\": ...}", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = [{"type": "function", "function": {"name": tool.get("name")}}  # flat, as response tools are
                 if isinstance(tool, dict) and tool.get("type") == "function" else tool for tool in choice["tools"]]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind == "allowed_tools":
        raise APIError(400, "tool_choice allowed_tools must be {\"type\": \"allowed_tools\", \"mode\": \"auto\" | \"required\", "
                       "\"tools\": [{\"type\": \"function\", \"name\": ...}, ...]}", param="tool_choice")
    raise APIError(400, f"tool_choice {kind!r} is not supported: \"none\", \"auto\", \"required\", {{\"type\": \"function\", "
                   "\"name\": ...}, or {\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]} (function tools only)",
                   param="tool_choice")


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
def new_ids(body: dict) -> tuple[str, int]:
    """The response's id (the client's ``request_id`` where it gave one, as vLLM's) and its creation time."""
    return body.get("request_id") or f"resp_{uuid.uuid4().hex}", int(time.time())


def response_dict(body: dict, response_id: str, created: int, model: str, status: str, output: list, usage: dict | None,
              error: dict | None = None) -> dict:
    def given(key: str, default: Any = None) -> Any:
        return body[key] if body.get(key) is not None else default

    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": given("instructions"), "max_output_tokens": given("max_output_tokens"), "output": output,
        "parallel_tool_calls": given("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": {"effort": given("reasoning").get("effort"), "summary": None} if isinstance(given("reasoning"), dict) else None,
        "store": False, "temperature": given("temperature"), "top_p": given("top_p"),
        "text": given("text", {"format": {"type": "text"}}), "tool_choice": given("tool_choice", "auto"),
        "tools": given("tools", []), "truncation": given("truncation", "disabled"), "metadata": given("metadata", {}),
        "user": given("user"), "usage": usage, "max_tool_calls": given("max_tool_calls"),
    }


def message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(item_id: str, text: str) -> dict:
    """A reasoning model's thinking (app/api/reasoning.py), as its own output item before the answer."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "in_progress"}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def logprobs_of(chat_logprobs: dict | None) -> list:
    """The chat answer's content logprobs as the Responses API lists them (the same token, logprob, bytes and top)."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes"),
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")} for t in e.get("top_logprobs") or []]}
            for e in (chat_logprobs or {}).get("content") or []]


def usage_of(usage: dict | None) -> dict | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def parse_request(raw: bytes) -> tuple[dict, Any]:
    """A response request's body and the chat request it asks for (400s as the chat endpoints give them)."""
    from app.api.bodies import json_object, require_plain_text
    from app.api.protocol import ChatCompletionRequest, parse_body

    body = json_object(raw)
    require_plain_text(body)  # what is only echoed back too: a lone surrogate would fail the answer's encoding
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise APIError(400, "truncation must be \"auto\" or \"disabled\"", param="truncation")
    try:
        request = parse_body(chat_body(body), ChatCompletionRequest)
    except APIError as error:
        raise named_for_responses(error) from None
    # "auto": an input past the context loses its oldest turns (the model's replica knows its context and tokenizer)
    request._fit_by_dropping_oldest = body.get("truncation") == "auto"
    return body, request


def named_for_responses(exc: BaseException) -> BaseException:
    """A chat request's error (its parse, or the model's answer: a prompt past the context) named as the response
    request names its fields: the APIError the client reads, also inside Ray's wrapper of a model on another
    replica. ``exc`` itself is returned, renamed in place."""
    error = client_error(exc)
    for chat_name, name in _NAMES if error is not None else ():
        error.message = error.message.replace(chat_name, name)
        error.param = error.param.replace(chat_name, name, 1) if error.param else error.param
    return exc
