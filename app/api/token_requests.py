"""The requests beside completions and chat: the seeds' ``/v1/generate`` (a prompt and a token budget, read as a
completion) and vLLM's ``/tokenize`` and ``/detokenize``; parsed as strictly as app/api/protocol.py parses the
others."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from app.api import legacy_functions
from app.api.chat_message import ChatMessage
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.api.strict_model import StrictModel
from app.engine.request import INT64_MAX, INT64_MIN


class GenerateRequest(StrictModel):
    """The seeds' simple endpoint: a prompt and a token budget; the rest mirrors completions."""

    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(64, ge=1, le=INT64_MAX)
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False

    def to_completion(self) -> CompletionRequest:
        fields = self.model_dump(exclude={"max_new_tokens"}, exclude_none=True)
        return CompletionRequest(max_tokens=self.max_new_tokens, **fields)


class TokenizeRequest(StrictModel):
    """vLLM's ``POST /tokenize``: the token ids a completion's ``prompt`` or a chat's ``messages`` (with ``tools``)
    would send to the model."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # a prompt's: the tokenizer's BOS (messages: none unless set, as a chat request's)
    add_generation_prompt: bool = True  # messages': the template's opening of the assistant's turn
    continue_final_message: bool = False  # messages': the final message left open, as a chat request's
    chat_template_kwargs: dict[str, Any] | None = None  # messages': the template's own variables, as a chat request's
    documents: list[dict[str, Any]] | None = None  # messages': retrieved documents, as a chat request's
    # messages': what else shapes a chat's prompt (tool_choice none shows a template that renders no tools none)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _legacy_messages(cls, data: Any) -> Any:
        """A transcript's deprecated function messages, read as a chat request reads them (app/api/legacy_functions.py)."""
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            return {**data, "messages": legacy_functions.translated_messages(data["messages"])}
        return data

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        return self

    def chat_request(self) -> "ChatCompletionRequest":
        """The chat request whose prompt ``messages`` and ``tools`` make."""
        messages = [m.model_dump(exclude_none=True) for m in self.messages or []]
        fields = self.model_dump(include={"tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                                          "documents", "add_special_tokens", "tool_choice", "parallel_tool_calls",
                                          "reasoning_effort"}, exclude_unset=True, exclude_none=True)
        return parse_body({"messages": messages, **fields}, ChatCompletionRequest)


class DetokenizeRequest(StrictModel):
    """vLLM's ``POST /detokenize``: the text of token ids."""

    model: str | None = None
    tokens: list[int] = Field(min_length=1)
