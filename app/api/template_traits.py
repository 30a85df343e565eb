"""What a model's chat template takes, found by rendering small conversations through it once, and messages shaped to it.

Chat templates differ in what they accept beyond ``role`` and ``content`` text, and fail or go silent otherwise:

- llava-hf's (and other multimodal checkpoints') loop over ``content`` as a list of parts: given a string, they
  render nothing of it (the model sees the role labels alone). Such a template gets every message's text as one
  ``{"type": "text"}`` part, as vLLM detects and passes them.
- Gemma 1's and 2's raise on a ``system`` message (older Phi-3 and Mistral templates drop it), and Gemma's on anything
  but user and model turns in turn. There the system messages (the client's, or the tools this server shows to a
  template that renders none) open the first user turn, as Gemma's model card advises, and, where the template
  refuses a tool message, tool results are user turns, consecutive ones joined. Mistral's and Llama 2's take one
  system message only (and raise on a second): a Responses request's instructions and a developer item are joined.
- Mistral's take tool call ids of 9 letters and digits only (and raise otherwise): ids of another shape (this
  server's ``call_...``, another provider's) are given as 9 characters derived from each, the same for a call and the
  tool message answering it.
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass

from app.api.mistral_calls import MISTRAL_MARKER

_MARK = "q7Zx3-probe"  # text no template writes by itself


@dataclass(frozen=True)
class TemplateTraits:
    content_as_parts: bool = False  # the template reads content as a list of parts
    system_role: bool = True  # it shows a system message
    tool_role: bool = True  # it shows a tool message after an assistant's turn
    short_call_ids: bool = False  # Mistral's: call ids of 9 letters and digits
    several_system: bool = True  # it shows a second leading system message (Mistral's and Llama 2's take one only)


def traits_of(tokenizer) -> TemplateTraits:
    """``tokenizer``'s default chat template's traits, probed once per template (cached on the tokenizer)."""
    source = _source(tokenizer.chat_template)
    cache = tokenizer.__dict__.setdefault("_template_traits", {})
    if source not in cache:
        cache[source] = _probed(tokenizer, source)
    return cache[source]


_PROBES = {"tools": [{"type": "function", "function": {"name": _MARK, "description": _MARK,
                                                       "parameters": {"type": "object", "properties": {}}}}],
           "documents": [{"title": _MARK, "text": _MARK}]}


def applied_template(template: str | dict | None, with_tools: bool, with_documents: bool = False) -> str:
    """Of a checkpoint's named templates (Hermes 2 Pro's, Command R's) the one rendered: ``tool_use`` where tools are
    passed (as transformers' ``get_chat_template`` picks it), else ``rag`` where documents are (as Command R's grounded
    generation takes it), else ``default``; a single template as it is ("" for none)."""
    if not isinstance(template, dict):
        return template or ""
    for name, wanted in (("tool_use", with_tools), ("rag", with_documents)):
        if wanted and name in template:
            return template[name] or ""
    return template.get("default") or ""


def shows(tokenizer, template: str, name: str) -> bool:
    """Whether ``template`` shows the model what it is passed as ``name`` (``tools``, ``documents``): a probe holding
    its text rendered once per template and name (Phi-4-mini's names "tools" but reads them off a system message's
    own field). One the probe cannot render (it needs more) is taken at its word: whether it names it."""
    cache = tokenizer.__dict__.setdefault("_shows", {})
    if (template, name) not in cache:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}], chat_template=template,
                                                 tokenize=False, add_generation_prompt=True, **{name: _PROBES[name]})
            cache[template, name] = _MARK in text
        except Exception:  # a template's raise_exception, or its own error on a conversation it does not take
            cache[template, name] = name in template
    return cache[template, name]


def shaped(messages: list[dict], traits: TemplateTraits, tools_as_text: bool) -> list[dict]:
    """``messages`` as the template takes them. ``tools_as_text``: tool results are this server's text (Hermes
    blocks for a template that renders no tools), which may become user turns."""
    if traits.short_call_ids:
        messages = [_with_short_ids(m) for m in messages]
    if not traits.system_role and messages and messages[0]["role"] == "system":
        messages = _system_in_first_user_turn(messages)
    elif not traits.several_system and len(messages) > 1 and messages[0]["role"] == messages[1]["role"] == "system":
        messages = _leading_system_joined(messages)
    if not traits.tool_role and tools_as_text:
        messages = _joined_turns([{**m, "role": "user"} if m["role"] == "tool" else m for m in messages])
    if traits.content_as_parts:
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                    for m in messages]
    return messages


def short_call_id(call_id: str) -> str:
    """A call id as Mistral's templates take it: itself if 9 letters and digits, else 9 derived from it."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = string.ascii_letters + string.digits
    return "".join(digits[(number // len(digits) ** i) % len(digits)] for i in range(9))


def _probed(tokenizer, source: str) -> TemplateTraits:
    if not source:
        return TemplateTraits()
    as_string = _shows(tokenizer, [{"role": "user", "content": _MARK}])
    as_parts = not as_string and _shows(tokenizer, [{"role": "user", "content": [{"type": "text", "text": _MARK}]}])
    if not as_string and not as_parts:  # a template the probes cannot render (it needs more): taken as it is
        return TemplateTraits(short_call_ids=MISTRAL_MARKER in source)
    wrap = (lambda text: [{"type": "text", "text": text}]) if as_parts else (lambda text: text)
    system = _shows(tokenizer, [{"role": "system", "content": wrap(_MARK)}, {"role": "user", "content": wrap("u")}])
    tool = _shows(tokenizer, [{"role": "user", "content": wrap("u")}, {"role": "assistant", "content": wrap("a")},
                              {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": wrap(_MARK)}])
    several = system and all(  # each of two shown: neither dropped
        _shows(tokenizer, [{"role": "system", "content": wrap(first)}, {"role": "system", "content": wrap(second)},
                           {"role": "user", "content": wrap("u")}]) for first, second in ((_MARK, "s"), ("s", _MARK)))
    return TemplateTraits(as_parts, system, tool, MISTRAL_MARKER in source, several)


def _shows(tokenizer, messages: list[dict]) -> bool:
    """Whether the template renders ``messages`` with the probe's text in it (no error, nothing dropped)."""
    try:
        return _MARK in tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template's raise_exception, or its own error on a shape it does not take
        return False


def _with_short_ids(message: dict) -> dict:
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**c, "id": short_call_id(c["id"])} if isinstance(c.get("id"), str) else c
                                             for c in message["tool_calls"]]}
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": short_call_id(message["tool_call_id"])}
    return message


def _leading_system_joined(messages: list[dict]) -> list[dict]:
    """The leading system messages (a Responses request's instructions, then a ``developer`` item) as one, a blank
    line apart."""
    system, rest = _leading_system(messages)
    return [{"role": "system", "content": system}, *rest]


def _leading_system(messages: list[dict]) -> tuple[str, list[dict]]:
    """The leading system messages' texts, a blank line apart (a client's ``developer`` one is a system one by now),
    and the messages after them."""
    count = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    return "\n\n".join(m["content"] for m in messages[:count]), list(messages[count:])


def _system_in_first_user_turn(messages: list[dict]) -> list[dict]:
    """The leading system messages as the first user turn's start, a blank line apart."""
    system, rest = _leading_system(messages)
    first_user = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if first_user is None:
        return [{"role": "user", "content": system}, *rest]
    rest[first_user] = {**rest[first_user], "content": f"{system}\n\n{rest[first_user]['content']}"}
    return rest


def _joined_turns(messages: list[dict]) -> list[dict]:
    """Consecutive user turns as one (their texts a blank line apart)."""
    joined: list[dict] = []
    for message in messages:
        if joined and message["role"] == "user" and joined[-1]["role"] == "user":
            joined[-1] = {**joined[-1], "content": f"{joined[-1]['content']}\n\n{message['content']}"}
        else:
            joined.append(message)
    return joined


def _source(template) -> str:
    if isinstance(template, dict):
        return template.get("default") or ""
    return template or ""
