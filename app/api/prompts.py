"""A model's prompts as token ids: a completion's (text or ids, one or several), a chat's through the model's chat
template (tools shown as it renders them, or as Hermes text where it renders none), and vLLM's /tokenize and
/detokenize, which read them the same way."""

from __future__ import annotations

import asyncio
import inspect
import itertools

from app.api import reasoning, tools
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest
from app.api.template_traits import applied_template, shaped, shows, traits_of
from app.api.token_requests import DetokenizeRequest, TokenizeRequest


class Prompts:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_model_len, self.vocab_size = max_model_len, vocab_size

    def completion(self, prompt, add_special_tokens: bool = True) -> list[list[int]]:
        """One or several prompts (text, or token ids), each as token ids; a text's with the tokenizer's special tokens
        (a BOS) unless ``add_special_tokens`` is false."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return [self._completion_one(p, add_special_tokens) for p in prompt]
        return [self._completion_one(prompt, add_special_tokens)]

    def _completion_one(self, prompt, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}", param="prompt")
        return list(prompt)

    async def tokenize(self, request: TokenizeRequest) -> dict:
        ids = await asyncio.to_thread(self._tokenized, request)  # a template and a long prompt: off the loop
        answer = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if request.return_token_strs:
            answer["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return answer

    def _tokenized(self, request: TokenizeRequest) -> list[int]:
        if request.messages is not None:
            return self.chat(request.chat_request())
        return self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {self.vocab_size}); got {bad[0]}", param="tokens")
        # off the event loop, as /tokenize: a million ids take ~0.6 s to decode
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, request.tokens)}

    def chat(self, request: ChatCompletionRequest) -> list[int]:
        return self.encoded_chat(self.chat_text(request), request)

    def encoded_chat(self, text: str, request: ChatCompletionRequest) -> list[int]:
        # The template already wrote the special tokens it wants: no second BOS, unless asked (vLLM's add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def chat_text(self, request: ChatCompletionRequest, opens_a_turn: bool | None = None) -> str:
        """The chat's prompt as the model's template writes it (``opens_a_turn``: False renders it without the
        answer's turn opened, whatever the request asks)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template; use /v1/completions", param="messages")
        messages = _known_roles([m.as_template_message() for m in request.messages], self.tokenizer.chat_template)
        listed = request.parsed_tools()
        shown = listed if request.tool_choice_resolved() is not None else []  # tool_choice none: no call is invited
        extra = {}
        tools_as_text = not tools.template_renders_tools(self.tokenizer, bool(listed))
        if not tools_as_text:  # as vLLM: under none too, in the model's format
            extra = {"tools": [t.as_openai() for t in listed]} if listed else {}
            messages = [tools.with_loaded_arguments(m) for m in messages]
        else:  # a template without tools: tools, calls and results as Hermes-style text
            messages = tools.render_for_template(messages, shown)
        messages = shaped(messages, traits_of(self.tokenizer), tools_as_text)  # as this template takes them
        variables = self._template_variables(request.chat_template_kwargs)
        if request.documents is not None:
            variables["documents"] = request.documents
        if variables.get("documents"):
            extra["chat_template"] = self._documents_template(bool(listed))
        if request.reasoning_effort is not None:  # as vLLM: the template's if it reads it, else its thinking switch
            variables["reasoning_effort"] = request.reasoning_effort
            variables.setdefault("enable_thinking", request.reasoning_effort != "none")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.opens_a_turn if opens_a_turn is None else opens_a_turn,
                continue_final_message=request.continue_final_message,
                tokenize=False, **extra, **variables)
        except Exception as exc:  # template errors (e.g. role order) come from the model's own template
            raise APIError(400, f"the model's chat template rejected the messages: {exc}", param="messages") from exc
        return text

    def turn_opening(self, request: ChatCompletionRequest, text: str) -> str:
        """What the template writes after the last message to open the answer's turn (Qwen3's ``<think>``, or its
        empty block with thinking off), ``text`` being the whole prompt: its part past what it shares with the same
        messages rendered without the opening (Phi's templates end that one with EOS instead), from the start of a
        marker the two began alike (``<think>`` against ``</s>``); "" where the request opens no turn, or the template
        takes the messages only with it."""
        if not request.opens_a_turn:
            return ""
        try:
            closed = self.chat_text(request, opens_a_turn=False)
        except APIError:
            return ""
        cut = _shared_length(text, closed)
        marker = text.rfind("<", max(cut - len(reasoning.CLOSE) + 1, 0), cut)
        return text[marker if marker >= 0 else cut:]

    def fitted_chat(self, request: ChatCompletionRequest, limit: int) -> list[int]:
        """The chat's prompt, its oldest turns dropped until it is at most ``limit`` tokens (the Responses API's
        ``truncation: "auto"``): the leading system and developer messages stay, and what is left starts at a user
        message. The fewest turns are dropped (a binary search over where the kept part starts: each render a template
        and a tokenizing); if even the last user turn on is too long, the context's 400."""
        messages = request.messages
        head = list(itertools.takewhile(lambda m: m.role in ("system", "developer"), messages))  # instructions and all
        starts = [i for i, m in enumerate(messages) if i >= len(head) and m.role == "user"]

        def prompt_from(start: int) -> list[int]:
            return self.chat(request.model_copy(update={"messages": head + messages[start:]}))

        low, high, found = 0, len(starts) - 1, None  # no user turn to start at: nothing that can be kept alone
        while low <= high:
            middle = (low + high) // 2
            ids = prompt_from(starts[middle])
            if len(ids) <= limit:
                found, high = ids, middle - 1
            else:
                low = middle + 1
        if found is None:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the input from its "
                           "last user turn on leaves too little room for the answer. Shorten it.", param="messages",
                           code="context_length_exceeded")
        return found

    def _documents_template(self, with_tools: bool) -> str:
        """The template a request's documents are rendered with (``applied_template``: with tools, the one whose showing
        of them was asked); a 400 where it would drop them."""
        template = applied_template(self.tokenizer.chat_template, with_tools, with_documents=True)
        if not shows(self.tokenizer, template, "documents"):
            raise APIError(400, f"model {self.model_name!r}'s chat template shows no documents: they would be dropped; "
                           "give them in a message instead", param="documents")
        return template

    def _template_variables(self, kwargs: dict | None) -> dict:
        """``chat_template_kwargs``: variables for the template to read, as vLLM passes them (one the template never
        reads changes nothing, as in vLLM: clients send e.g. ``enable_thinking`` to every model), and ``documents``. A
        name the template call itself takes (``tools``, ``tokenize``, ...) is not a variable: a 400 that says where it
        belongs."""
        kwargs = dict(kwargs or {})
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        taken = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} - {"documents"} | {"messages", "conversations"}
        for name in kwargs:
            if name in taken:
                raise APIError(400, f"chat_template_kwargs cannot set {name!r}: the server sets it from the request "
                               "(messages, tools, add_generation_prompt, continue_final_message are request fields)",
                               param=f"chat_template_kwargs.{name}")
        return kwargs


def _shared_length(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, found by halving (slice comparisons, not a
    character loop over a long prompt)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _known_roles(messages: list[dict], template) -> list[dict]:
    """``developer`` messages as ``system`` ones where the template never names the role (most do not): OpenAI
    treats the two alike for models without it, as vLLM renders them; the template would otherwise show the model a
    role it never saw, or drop the instructions."""
    source = "\n".join(template.values()) if isinstance(template, dict) else template
    if "developer" in source:
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
