"""Tool calling: the request's tools in the prompt, the model's calls out of its text.

- ``tool_choice`` ``"required"`` or a named function: the output is constrained by a grammar (structured outputs)
  to JSON the call's schema accepts, so the arguments always validate: a named function's output is its
  arguments object; ``required``'s is a list of ``{"name", "arguments"}`` (one call if ``parallel_tool_calls`` is
  false).
- ``"auto"``: the model writes calls in its own format, read back by the model's parser (``model.tool_parser``):
  ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``, Qwen, Hermes, and the default), ``llama3_json``
  (a bare ``{"name", "parameters"}`` object, optionally after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]``
  then a JSON list, or ``name[ARGS]{...}`` per call from tokenizer v11 on: app/api/mistral_calls.py),
  ``qwen3_coder`` (XML-like blocks: app/api/xml_calls.py). Text the parser cannot read as a call stays the answer's
  content: nothing is dropped. For Hermes, a tool's ``strict: true`` holds the calls to the
  tools' schemas by a grammar while the text stays free (``strict_calls``); beside a JSON response format the
  grammar is the format's answer or calls (``answer_or_calls``).
- ``"none"`` (or no tools): plain chat, no call read out of the answer; a template that renders tools still gets them,
  as vLLM passes them (a transcript's earlier calls read against their definitions), but no text inviting calls is
  added to a template that does not.

A chat template that renders tools itself (a probe tool passed to it shows in its text) gets them as transformers
passes them.
Templates that do not, like the embedded SmolLM2's, which joins only ``role`` and ``content``, get the tools as a
system message and earlier calls and results as text, in the Hermes format the default parser reads.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from app.api.errors import NOT_JSON, APIError
from app.api.call_readers import END, MARKER, PYTHON_TAG, HermesReader, ListReader, call_from
from app.api.mistral_calls import MISTRAL_MARKER, MistralReader
from app.api.schemas import call_schema, closed, tools_schema
from app.api.template_traits import applied_template, shows
from app.api.structured import compiled, json_in_lark, require_compilable_size, special_token, token_or_text
from app.api.xml_calls import XmlReader
from app.config.model import TOOL_PARSERS
_TOOLS_PREAMBLE = ("You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
                   "To call one, answer with <tool_call>{{\"name\": <function name>, \"arguments\": <arguments object>}}"
                   "</tool_call>, one block per call.")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False  # OpenAI's strict mode: the arguments always follow the schema, under any tool_choice

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_TOOL_KEYS = {"type", "function", "defer_loading"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict", "defer_loading"}


def require_loaded(value: Any, param: str) -> None:
    """OpenAI's ``defer_loading`` (a tool the model finds by searching): taken at its default, every tool shown."""
    if value not in (None, False):
        raise APIError(400, f"{param} is not supported: every tool is shown to the model (leave it false)", param=param)


def parse_tools(tools: list[Any] | None) -> list[Tool]:
    parsed = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}",
                           param=f"tools[{i}]")
        for key, known, where in ((set(tool), _TOOL_KEYS, f"tools[{i}]"), (set(function), _FUNCTION_KEYS, f"tools[{i}].function")):
            if key - known:  # a misspelt "parameters" would otherwise make a function of no arguments
                unknown = sorted(key - known)[0]
                raise APIError(400, f"Unrecognized request argument supplied: {where}.{unknown} (known: {', '.join(sorted(known))})",
                               param=f"{where}.{unknown}", code="unknown_parameter")
        require_loaded(tool.get("defer_loading"), f"tools[{i}].defer_loading")
        require_loaded(function.get("defer_loading"), f"tools[{i}].function.defer_loading")
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(parameters, dict):
            raise APIError(400, "a function's parameters must be a JSON schema object", param=f"tools[{i}].function.parameters")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise APIError(400, "a function's strict must be true or false", param=f"tools[{i}].function.strict")
        parsed.append(Tool(function["name"], function.get("description") or "", parameters, function.get("strict") is True))
    if len({t.name for t in parsed}) != len(parsed):
        raise APIError(400, "tool names must be unique", param="tools")
    return parsed


def resolve_choice(tool_choice: Any, tools: list[Tool]) -> str | Tool | None:
    """None (no tool calling), ``"auto"``, ``"required"``, or the named function's Tool."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if tool_choice in ("auto", "required"):
        if not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    for tool in tools:
        if tool.name == name:
            return tool
    raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")


def allowed_tools(tool_choice: Any, tools: list[Tool]) -> tuple[str, list[Tool]] | None:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
    "function", "function": {"name": ...}}, ...]}}``: (its mode, the tools it allows), or None for any other choice.
    The model is shown, and may call, those tools alone."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "allowed_tools":
        return None
    spec = tool_choice.get("allowed_tools")
    entries = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required") or not isinstance(entries, list) or not entries:
        raise APIError(400, 'tool_choice allowed_tools must be {"mode": "auto" | "required", "tools": [{"type": "function", '
                       '"function": {"name": ...}}, ...]}', param="tool_choice.allowed_tools")
    by_name = {tool.name: tool for tool in tools}
    allowed: dict[str, Tool] = {}  # each once, in the order given
    for i, entry in enumerate(entries):
        function = entry.get("function") if isinstance(entry, dict) and entry.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in by_name:
            kind = entry.get("type") if isinstance(entry, dict) else type(entry).__name__
            raise APIError(400, f"tool_choice allowed_tools.tools[{i}] ({kind!r}) names no function among the tools: "
                           "function tools only", param=f"tool_choice.allowed_tools.tools[{i}]")
        allowed[name] = by_name[name]
    return spec["mode"], list(allowed.values())


def forced_schema(choice: str | Tool, tools: list[Tool], parallel: bool) -> dict | None:
    """The JSON schema a ``required`` or named call's output must follow (None for ``auto``)."""
    if isinstance(choice, Tool):
        return closed(choice.parameters)  # no keys the schema does not list (app/api/schemas.py)
    if choice != "required":
        return None
    return tools_schema([(t.name, closed(t.parameters)) for t in tools], parallel)


def answer_or_calls(found_format: tuple[tuple[str, str], str], tools: list[Tool], parser: str, parallel: bool,
                    tokenizer=None) -> str:
    """The grammar of ``tool_choice: auto`` beside a response format: an answer in the format, or the model's tool
    calls (Hermes blocks, each call's arguments held to its tool's schema), whichever the model begins; the format
    holds the answer, not the calls, as OpenAI applies it. Other call formats, and formats other than JSON: a 400."""
    (kind, text), param = found_format
    keep = "set tool_choice to \"none\" to answer in the format, or to \"required\" or a named function to call a tool"
    if parser != "hermes":
        raise APIError(400, f"{param} beside tools under tool_choice auto is served for models that write Hermes tool "
                       f"calls; this one writes {parser}'s: {keep}", param=param)
    if kind != "json":
        raise APIError(400, f"{param}: only a JSON format can stand beside tools under tool_choice auto, not a {kind}: "
                       f"{keep}", param=param)
    calls = 'call (WS? call)*' if parallel else "call"
    call = _hermes_call(tools, strict_only=False, tokenizer=tokenizer)
    rules = f"%llguidance {{}}\nstart: answer | calls\nanswer: {json_in_lark(text)}\ncalls: {calls}\ncall: {call}\n"
    return compiled("lark", rules + _WHITESPACE, param)


def strict_calls(tools: list[Tool], parser: str, parallel: bool, tokenizer=None) -> str | None:
    """The grammar of ``tool_choice: auto`` where a tool asks ``strict: true`` (the openai Agents SDK's default), as
    OpenAI's strict mode promises: the answer stays free text, and a call the model begins (its Hermes marker) names
    one of the tools, a strict tool's arguments held to its schema (another's to any object). The text runs lazily
    up to a call's marker (llguidance's pattern for tools in text). None where no tool is strict, or the model writes
    another call format (its calls then are the model's own, as vLLM leaves them under auto)."""
    if parser != "hermes" or not any(tool.strict for tool in tools):
        return None
    calls = "call* TEXT" if parallel else "call? TEXT"  # every marker begins a call: one only, if not parallel
    marker = token_or_text(tokenizer, MARKER)
    if marker.startswith("<["):  # a token of its own; the text holds no marker spelled in pieces either (no unchecked call)
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*){MARKER}(?s:.*)/\nbefore_call: TEXT {marker}\n"
    else:
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*){MARKER}(?s:.*)/\nbefore_call[lazy]: TEXT {marker}\n"
    call = _hermes_call(tools, strict_only=True, marked=False, tokenizer=tokenizer)
    return compiled("lark", f"%llguidance {{}}\nstart: {calls}\n{text}call: before_call {call}\n" + _WHITESPACE, "tools")


_WHITESPACE = "WS: /[ \\t\\r\\n]+/\n"


def _hermes_call(tools: list[Tool], strict_only: bool, marked: bool = True, tokenizer=None) -> str:
    """A Hermes call block's rule body, as the chat template or this server's preamble writes it (whitespace inside
    the markers optional): its JSON names one of the tools, and its arguments follow the tool's schema (closed:
    app/api/schemas.py); with ``strict_only``, only a strict tool's do. ``marked``: the opening marker included.
    The keys in either order: Qwen's templates write the name first, Hermes 2 Pro's the arguments (a grammar holds
    an object's keys to its schema's order, so each order is a schema of its own)."""
    calls_schema = call_schema([(t.name, closed(t.parameters) if t.strict or not strict_only else {"type": "object"})
                                for t in tools])
    arguments_first = {**calls_schema, "anyOf": [{**call, "properties": dict(reversed(call["properties"].items()))}
                                                 for call in calls_schema["anyOf"]]}
    require_compilable_size([calls_schema, arguments_first], "tools")  # what the engine compiles: both
    either = " | ".join(json_in_lark(json.dumps(schema)) for schema in (calls_schema, arguments_first))
    opening = f"{token_or_text(tokenizer, MARKER)} " if marked else ""  # as the tokenizer writes the markers
    return f"{opening}WS? ({either}) WS? {token_or_text(tokenizer, END)}"


def forced_calls(text: str, choice: str | Tool) -> list[ToolCall]:
    """The calls in a constrained output (it follows forced_schema; cut short by max_tokens, as far as they came),
    each one's arguments as the model wrote them, as a stream sends them."""
    if isinstance(choice, Tool):
        return [ToolCall(choice.name, text.strip())]
    return [ToolCall(name, arguments) for name, arguments in required_calls(text)]  # none named yet: the text stays content


def whole_arguments(calls: list[ToolCall]) -> bool:
    """Whether every call's arguments are whole JSON: an answer a stop string ended inside a call has one that is not
    (its text then stays content, as no call was made)."""
    try:
        for call in calls:
            json.loads(call.arguments)
    except (*NOT_JSON, TypeError):
        return False
    return True


def required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a ``required`` output (``[{"name": "<name>", "arguments": <JSON>}, ...]``, as its grammar writes
    it) so far: each named one with its arguments' text as far as it goes."""
    reader = ListReader()
    reader.feed(text)
    return [(name, arguments) for name, arguments in reader.calls]


def parse_calls(text: str, parser: str, tools: list[Tool] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a free answer in ``parser``'s format; what is not a readable call stays content.
    ``tools``: the request's, whose schemas type ``qwen3_coder``'s raw parameter values."""
    if parser == "hermes":  # read as a stream reads it (app/api/call_readers.py)
        reader = HermesReader()
        reader.feed(text)
        content, calls = reader.finish()
        return content, [ToolCall(name, arguments) for name, arguments in calls]
    if parser == "llama3_json":  # an answer opening with a call is calls (Llama 3 writes nothing else then)
        found, after = llama3_calls(text)
        return ((after.strip() or None), [ToolCall(*call) for call in found]) if found else (text, [])
    if parser == "mistral":
        head, marker, body = text.partition(MISTRAL_MARKER)
        found, after = mistral_calls(body) if marker else ([], "")
        return ((head + after).strip() or None, [ToolCall(*call) for call in found]) if found else (text, [])
    if parser == "qwen3_coder":
        reader = XmlReader(schemas_of(tools))  # read as a stream reads it
        reader.feed(text)
        content, calls = reader.finish()
        return content, [ToolCall(name, arguments) for name, arguments in calls]
    raise ValueError(f"unknown tool parser {parser!r} (known: {', '.join(TOOL_PARSERS)})")


def mistral_calls(body: str) -> tuple[list[tuple[str, str]], str]:
    """A whole answer's calls after ``[TOOL_CALLS]`` (a JSON list, or v11's ``name[ARGS]{...}`` calls:
    app/api/mistral_calls.py), read as a stream reads them (each one's arguments the model's text; cut short, as far
    as they came), then any in another shape (keys in another order, arguments as a string) from a whole list; and
    the text after them, which is content."""
    reader = MistralReader()
    reader.feed(body)
    found = [(name, arguments) for name, arguments in reader.calls]
    if reader.stopped is None:
        return found, body[reader.end:] if reader.end is not None else ""
    if reader.compact:
        return found, body[reader.stopped:]
    try:
        listed, end = json.JSONDecoder().raw_decode(body.lstrip())
    except NOT_JSON:
        listed, end = None, 0
    others = [call_from(item, ("arguments",)) for item in listed[len(found):]] if isinstance(listed, list) else [None]
    if not all(others):
        return found, body[reader.stopped:]
    return found + others, body.lstrip()[end:]


def llama3_calls(text: str) -> tuple[list[tuple[str, str]], str]:
    """A whole answer's Llama 3 calls (``{"name", "parameters"}`` objects, after ``<|python_tag|>`` or not, separated
    by ``;``), read as a stream reads them (``ListReader``), then, where every part after them reads as a call in
    another shape (keys in another order), those; and the text after them, which is content."""
    reader = ListReader(llama3=True)
    reader.feed(text)
    found = [(name, arguments) for name, arguments in reader.calls]
    if reader.stopped is None:
        return found, text[reader.end:] if reader.end is not None else ""
    rest = text[reader.stopped:]
    body = rest.strip().removeprefix(PYTHON_TAG).strip()
    parts = body.split(";") if body.startswith("{") else [None]
    others = [call_from(_json_or_none(part), ("parameters", "arguments")) if part else None for part in parts]
    if not all(others):
        return found, rest
    return found + others, ""


def schemas_of(tools: list[Tool] | None) -> dict[str, dict]:
    """Each tool's ``properties`` by its name: what types Qwen3-Coder's raw parameter values."""
    return {tool.name: tool.parameters.get("properties") or {} for tool in tools or []}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except NOT_JSON:
        return None


def tool_parser_for(setting: str, tokenizer) -> str:
    """``model.tool_parser``, where ``auto`` reads the format off the chat template that teaches it: Mistral's
    ``[TOOL_CALLS]``, Qwen3-Coder's ``<function=...>`` blocks, Llama 3's ``<|python_tag|>`` or its JSON with
    ``"parameters"``, else Hermes (Qwen2.5/Qwen3,
    Hermes; and the format this server shows to templates without tools)."""
    if setting != "auto":
        return setting
    template = getattr(tokenizer, "chat_template", None) or ""
    template = "\n".join(template.values()) if isinstance(template, dict) else template
    if MISTRAL_MARKER in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:  # Qwen3-Coder
        return "qwen3_coder"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def marker_is_special(tokenizer) -> bool:
    """Whether Hermes' ``<tool_call>`` is a special token (some checkpoints add it so): such requests keep special
    tokens in their text, or no call could be read."""
    return special_token(tokenizer, MARKER)


def template_renders_tools(tokenizer, with_tools: bool) -> bool:
    """Whether the template transformers applies renders tools: of a checkpoint's named templates (Hermes 2 Pro's,
    Command R's) it takes ``tool_use`` when tools are passed, else ``default``, as ``get_chat_template`` does."""
    template = applied_template(getattr(tokenizer, "chat_template", None), with_tools)
    return "tools" in template and shows(tokenizer, template, "tools")


_SHOWN_AS_GIVEN = ("name", "reasoning_content", "reasoning")  # a message's fields a template may read besides its text


def render_for_template(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Messages for a template that renders no tools: the tools in a system message, earlier calls and results
    as text in the Hermes format."""
    preamble = _TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools)) if tools else None
    rendered = []
    for message in messages:
        kept = {key: message[key] for key in _SHOWN_AS_GIVEN if key in message}  # for templates that read them
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': loaded_arguments(c['function']['arguments'])})}\n</tool_call>"
                            for c in message["tool_calls"])
            rendered.append({"role": "assistant", "content": (message.get("content") or "") + calls, **kept})
        elif message["role"] == "tool":
            rendered.append({"role": "tool", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
                             **kept})
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or "", **kept})
    if preamble is not None:
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + preamble}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered


def loaded_arguments(arguments: str) -> dict:
    """An earlier call's arguments as the object they are; ``{}`` for text that is none (empty, or an answer cut short
    inside its call, which this server answers as a call): a template iterating them would fail on text, and the
    conversation goes on, as vLLM renders them."""
    try:
        loaded = json.loads(arguments)
    except (*NOT_JSON, TypeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def with_loaded_arguments(message: dict) -> dict:
    """Templates that render tool calls (transformers' convention) read arguments as a mapping, not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": loaded_arguments(c["function"].get("arguments"))}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
