"""A chat answer's assistant message from its whole text: the calls read out of it (app/api/tools.py) and a reasoning
model's thinking apart (app/api/reasoning.py), as the non-streamed answer gives it."""

from __future__ import annotations

import functools

from app.api import reasoning, tools
from app.api.fanout import Prepared


def assistant_message(plan: Prepared, text: str, choice, tool_parser: str, one_call: bool, shown: list,
                      finish_reason: str | None) -> dict:
    """The message, its reasoning apart where the model's parser splits it (calls read from the rest)."""
    build = functools.partial(chat_message, choice=choice, tool_parser=tool_parser, one_call=one_call, shown=shown,
                              finish_reason=finish_reason)
    if plan.reasoning_inside is None:
        return build(text)
    return reasoning.reasoned_message(text, plan.reasoning_inside, plan.reasoning_shown, build, plan.call_ends_thinking)


def chat_message(text: str, choice, tool_parser: str, one_call: bool = False, shown: list | None = None,
                 finish_reason: str | None = "stop") -> dict:
    """The assistant's message; with tool calling, the calls read out of its text. With ``parallel_tool_calls: false``
    a free answer keeps its first call only, as vLLM does (a required or named choice's grammar already allows just
    one). Calls a stop string ended inside are no calls: the text is the content (cut by max_tokens, they are given as
    far as they came, with finish_reason "length")."""
    if choice is None:
        return {"role": "assistant", "content": text}
    if choice == "auto":
        content, calls = tools.parse_calls(text, tool_parser, shown)
        calls = calls[:1] if one_call else calls
    else:  # constrained to the call's JSON: no content unless cut short (then the text, finish_reason "length")
        calls = tools.forced_calls(text, choice)
        content = None if calls else text
    if calls and finish_reason == "stop" and not tools.whole_arguments(calls):
        content, calls = text, []
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
    return message
