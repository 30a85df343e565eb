"""OpenAI request bodies (pydantic), parsed strictly: an unknown field is an error, not ignored,
and so is a value of the wrong JSON type, as in OpenAI's API: "true" is not a boolean and "5" not a
number (pydantic's default lax mode would coerce both), nor is true an integer; an integer is a
number, though (``temperature: 1`` is fine).

Fields that OpenAI defines but the engine does not honour yet are accepted only at their
no-op value; anything else gets a 400 that names the field, so nothing a client asked for is
silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import Field, PrivateAttr, model_validator

from app.api import legacy_functions
from app.api.bodies import json_object, require_plain_text
from app.api.chat_message import ChatMessage
from app.api.errors import APIError
from app.api.fanout import MAX_CHOICES, MAX_GENERATIONS
from app.api.strict_model import StrictModel
from app.api.structured import compiled, request_grammar
from app.api.tools import Tool, allowed_tools, forced_schema, parse_tools, resolve_choice
from app.engine.request import INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_LOGPROBS, MAX_STOP_CHARS, SamplingParams


# What an unset field means, unless the model's config sets `default_sampling`.
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "guided_whitespace_pattern": "whitespace_pattern"}  # vLLM's older fields: structured_outputs' keys


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far
    include_obfuscation: bool = True  # OpenAI's padding of streamed chunks against length side channels: none here


class _SamplingFields(StrictModel):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # past the vocabulary: no top-k, as vLLM
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # at most 100, and at least its inverse (vLLM takes any positive one; one near 1e-32 overflows a logit in float32)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # int64, as OpenAI and vLLM take it
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # checked against the vocabulary by the serving layer
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the output stays in it
    return_token_ids: bool = False  # vLLM's: the prompt's and the answer's token ids beside the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:<id>", not by its text
    # vLLM's: the prompt's KV is shared through the prefix cache only with requests of the same salt (one per tenant)
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: the client's id for the request, in the answer's id ("chatcmpl-<it>"); the engine keeps ids of its own
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0  # vLLM's: only its default, first come first served, is taken (vLLM's default policy too)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's, and n alternatives
    # vLLM's: a prompt longer than this many tokens loses its first ones ("right": its last ones); -1: the context less one
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] = "left"
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields that change nothing in generation: accepted and ignored (docs/api.md)
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor to `user`
    prompt_cache_key: str | None = None  # a cache-routing hint: the prefix cache needs none
    prompt_cache_retention: str | None = None  # how long OpenAI keeps a cached prefix: ours stay while memory allows
    prompt_cache_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices (each its own engine request: app/api/fanout.py)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's: the only tokens the answer may hold
    # vLLM's: words the answer never holds (as tokenized, alone or after a space); bounded before any is tokenized
    bad_words: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=4 * MAX_BAD_WORDS)
    spaces_between_special_tokens: bool = True  # vLLM's: a fast tokenizer joins special tokens as it decodes them
    use_beam_search: bool = False  # vLLM's: no beam search here (n / best_of sample choices)
    length_penalty: float = 1.0  # vLLM's: read by beam search alone
    # Structured outputs (app/api/structured.py): OpenAI's field, or vLLM's {json|regex|choice|grammar|json_object}
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        """vLLM's older ``guided_*`` fields (honoured up to vLLM 0.11; later ones ignore them, unconstrained) read as
        ``structured_outputs``; a request with both is a 400. ``guided_decoding_backend`` names what runs the grammar:
        llguidance here, whatever it says."""
        if not isinstance(data, dict) or not any(key.startswith("guided_") for key in data):
            return data
        data = {key: value for key, value in data.items() if key != "guided_decoding_backend"}
        guided = {kind: data.pop(key) for key, kind in _GUIDED.items() if key in data}
        guided = {kind: value for kind, value in guided.items() if value is not None}
        if guided and data.get("structured_outputs") is not None:
            raise APIError(400, "give structured_outputs or the older guided_* fields, not both",
                           param="structured_outputs")
        return {**data, "structured_outputs": guided} if guided else data

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None,
                        bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """Fields the client left unset take the model's configured defaults, then OpenAI's; ``bad_words`` as the
        serving layer tokenized them."""
        defaults = {**OPENAI_DEFAULTS, **(defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return defaults[name] if value is None else value

        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                **{name: pick(name) for name in OPENAI_DEFAULTS},
                seed=None if self.seed == -1 else self.seed,  # as vLLM: -1 is no seed (llama.cpp's "random")
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=self.num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                logit_bias=_token_biases(self.logit_bias),
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
                bad_words_token_ids=bad_words_token_ids,
                grammar=self.grammar(),
            )
        except ValueError as exc:  # a combination the per-field checks cannot see (min_tokens > max_tokens, ...)
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from exc

    def grammar(self) -> str | None:
        """The grammar every output must follow (structured outputs), or None."""
        return request_grammar(self.response_format, self.structured_outputs)

    def num_logprobs(self) -> int | None:
        """How many alternatives per token the client asked for (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives per prompt token (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _reject_unsupported(self) -> None:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:  # {}: as vLLM
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.use_beam_search:
            raise APIError(400, "beam search is not supported: sample several choices with n (or best_of on completions)",
                           param="use_beam_search")
        if self.priority != 0:  # as vLLM without --scheduling-policy priority
            raise APIError(400, "priority is not supported: requests are served first come, first served (leave it 0)",
                           param="priority")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens 0 would leave no prompt: give at least 1, or -1 for the context "
                           "less one", param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they are the whole answer's
            raise APIError(400, "prompt_logprobs are not streamed; send stream: false for them", param="prompt_logprobs")
        if self.ignore_eos and self.grammar() is not None:
            raise APIError(400, "ignore_eos cannot be combined with structured outputs: a complete output ends with EOS",
                           param="ignore_eos")


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    biases: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():  # int() would take other digits too (an Arabic-Indic five), "1_0", " 5 "
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias keys must be token ids (integers, as strings); got {key[:20]!r}",
                           param="logit_bias")
        token = int(key)
        if not 0 <= token <= INT64_MAX:
            raise APIError(400, f"logit_bias key {key[:24]!r} is not a token id (ids run from 0 up to the vocabulary's size)",
                           param="logit_bias")
        if token in biases:  # "97" and "097": one bias would silently replace the other
            raise APIError(400, f"logit_bias names token {token} twice; give each token one bias", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias for token {token} is {value}; biases are in [-100, 100]", param="logit_bias")
        biases[token] = value
    return biases


_TOKEN_ID = re.compile(r"-?[0-9]+")


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0: with echo only (the prompt scored, nothing generated)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # legacy completions: the number of alternatives
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle, on models with FIM tokens (app/api/fim.py)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own special tokens (a BOS) around a text prompt
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # candidates per prompt; the n most likely are returned

    @model_validator(mode="before")
    @classmethod
    def _few_enough_prompts(cls, data: Any) -> Any:
        """More prompts than generations a request may ask for: a 400 before validation, which takes each prompt in one
        call that holds the GIL (~1 s for 500,000 small lists, while the replica's streams wait)."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and len(prompt) > MAX_GENERATIONS and isinstance(prompt[0], (str, list)):
            raise APIError(400, f"{len(prompt)} prompts is more than {MAX_GENERATIONS} generations; send fewer at once",
                           param="prompt")
        return data

    def _reject_unsupported(self) -> None:
        super()._reject_unsupported()
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.stream and (self.best_of or self.n) > self.n:
            raise APIError(400, "best_of cannot be streamed: the best candidates are known only at the end", param="best_of")
        if self.echo and self.suffix:  # the model reads the FIM layout, not the prompt echoed back ("": no suffix, as used)
            raise APIError(400, "echo cannot be combined with suffix: the model reads the prompt and the suffix in its "
                           "fill-in-the-middle layout, which the echoed prompt and its logprobs would not match", param="echo")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is taken with echo (the prompt and, with logprobs, "
                           "its tokens' logprobs)", param="max_tokens")
        prompts = len(self.prompt) if self.prompt and not isinstance(self.prompt, str) and not isinstance(self.prompt[0], int) else 1
        if prompts * (self.best_of or self.n) > MAX_GENERATIONS:  # before any is tokenized: a list can hold millions
            raise APIError(400, f"{prompts} prompts x {self.best_of or self.n} choices is more than {MAX_GENERATIONS} "
                           "generations; send fewer at once", param="prompt")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens come back with theirs (eval harnesses' loglikelihood requests); with
        prompt_logprobs too, as many alternatives as the wider asks (each answer shows its own number)."""
        echoed = self.logprobs if self.echo else None
        counts = [count for count in (echoed, self.prompt_logprobs) if count is not None]
        return max(counts) if counts else None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # ignored without tools
    # OpenAI fields of features this server has not: accepted unset or at OpenAI's default (_NO_OP_VALUES), else a 400
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    # To the chat template, as vLLM passes it: a template that reads it (or enable_thinking, "none" -> false) decides
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM's chat-template fields (app/api/prompts.py): the template's own variables (e.g. Qwen3's enable_thinking),
    # and how the prompt ends: the assistant's turn opened, or the final message left open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM's: an answer continuing the assistant's last message starts with that message
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None  # for templates that show retrieved documents (RAG)
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own (a BOS) before the template's text, which has its own
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the answer
    # A response request's ``truncation: "auto"`` (app/api/responses.py): no chat field, so no client sets it here
    _fit_by_dropping_oldest: bool = PrivateAttr(default=False)
    _legacy_functions: bool = PrivateAttr(default=False)  # answered as function_call (app/api/legacy_functions.py)

    @model_validator(mode="wrap")
    @classmethod
    def _functions_as_tools(cls, data: Any, handler) -> "ChatCompletionRequest":
        """OpenAI's deprecated functions and function_call (and a transcript's function messages) as tool calling."""
        legacy = False
        if isinstance(data, dict):
            data, legacy = legacy_functions.translated_request(data)
        request = handler(data)
        request._legacy_functions = legacy
        return request

    def _reject_unsupported(self) -> None:
        super()._reject_unsupported()
        choice = self.tool_choice_resolved()
        if choice not in (None, "auto") and (self.response_format or self.structured_outputs):
            raise APIError(400, "a required or named tool call already constrains the output; drop response_format "
                           "or structured_outputs", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if self.return_token_ids and self.stream and choice is not None:  # a call's chunks gather the text of several
            raise APIError(400, "return_token_ids is not streamed beside tool calling: a call goes out once its text is "
                           "whole, not token by token; send stream: false for the ids", param="return_token_ids")
        if not self.include_reasoning and (self.logprobs or self.return_token_ids or self.prompt_logprobs is not None):
            raise APIError(400, "include_reasoning: false cannot be combined with logprobs or token ids, which would show "
                           "the thinking's tokens", param="include_reasoning")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise APIError(400, "continue_final_message continues the final message, add_generation_prompt opens a new "
                           "turn after it: set one of them", param="continue_final_message")
        for name, why in _FEATURES_NOT_SERVED.items():
            value = getattr(self, name)
            if value is not None and value != _NO_OP_VALUES.get(name):
                raise APIError(400, f"{name} is not supported: {why}; leave it unset", param=name)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def parsed_tools(self) -> list[Tool]:
        """The tools the model is shown and may call: an ``allowed_tools`` choice's, else all."""
        tools = parse_tools(self.tools)
        allowed = allowed_tools(self.tool_choice, tools)
        return tools if allowed is None else allowed[1]

    def tool_choice_resolved(self) -> str | Tool | None:
        """None (no tool calling), "auto", "required" or the named function (app/api/tools.py)."""
        allowed = allowed_tools(self.tool_choice, parse_tools(self.tools))
        return resolve_choice(self.tool_choice if allowed is None else allowed[0], self.parsed_tools())

    def grammar(self) -> str | None:
        """A required or named tool call: JSON its schema accepts; otherwise the structured-output fields."""
        choice = self.tool_choice_resolved()
        schema = forced_schema(choice, self.parsed_tools(), self.parallel_tool_calls is not False) if choice else None
        if schema is None:
            return super().grammar()
        return compiled("json", json.dumps(schema), "tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def opens_a_turn(self) -> bool:
        """Whether the prompt ends by opening the assistant's turn (continue_final_message leaves the last one open)."""
        return self.add_generation_prompt and not self.continue_final_message


_NO_OP_VALUES = {"modalities": ["text"], "verbosity": "medium"}  # OpenAI's defaults: what this server does anyway
_FEATURES_NOT_SERVED = {
    "audio": "this server answers in text only", "modalities": "this server answers in text only",
    "prediction": "predicted outputs are not taken (speculative decoding drafts on its own)",
    "verbosity": "the model's chat template decides how long it answers",
    "web_search_options": "this server does not search the web",
}


def parse_body(raw: bytes | str | dict, model_cls: type[StrictModel]) -> Any:
    """Parse a request body into ``model_cls``, turning every problem into a 400 naming the field."""
    raw = json_object(raw)
    require_plain_text(raw)
    try:
        request = model_cls.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from exc
    if hasattr(request, "_reject_unsupported"):
        request._reject_unsupported()
    return request


_UNION_SHAPES = {  # by path, list indexes as "*"
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "messages.*.content": "a string or a list of content parts",
}
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


def _validation_error(exc: pydantic.ValidationError) -> APIError:
    first = exc.errors()[0]
    # the field's path, without the union member pydantic tried ("prompt.list[int].0" -> "prompt.0")
    param = ".".join(str(p) for p in first["loc"] if not _UNION_MEMBER.match(str(p))) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param, code="missing_parameter")
    if first["type"].endswith("_type"):  # bool_type, int_type, string_type, ...: the JSON type is wrong
        # a union's first error is its first member's ("Input should be a valid string" for a list of ids): say them all
        expected = _UNION_SHAPES.get(re.sub(r"\.[0-9]+", ".*", param or ""))
        message = f"give {expected}" if expected else first["msg"]
        return APIError(400, f"Invalid type for {param}: {message}", param=param, code="invalid_type")
    return APIError(400, f"Invalid value for {param}: {first['msg']}", param=param, code="invalid_value")
