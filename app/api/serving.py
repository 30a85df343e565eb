"""OpenAI completions and chat over an AsyncEngine: tokenize, validate, stream chunks, aggregate.

Pure Python (no ray): the model replica deployment hosts one OpenAIServing per model. Streaming
methods are async generators that yield OpenAI chunk dicts; validation happens before the first
yield, so a bad request fails on the first ``__anext__`` and the caller can still answer with a
proper HTTP status.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from app.engine import AsyncEngine, Request, RequestOutput, SamplingParams
from app.engine.request import TokenLogprob
from app.engine.async_engine import Admit
from app.metrics import RequestMetrics, RequestTiming


@dataclass
class _Prepared:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    created: int
    model: str  # the name the client asked for (answers carry it)
    drafter: int | None  # which of the engine's drafters drafts for it (None: none)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer,
        model_name: str,
        max_model_len: int,
        eos_token_ids,
        vocab_size: int,
        default_sampling: dict | None = None,
        admit: Admit | None = None,
        speculative_names: list[str | None] | None = None,
    ) -> None:
        """``speculative_names``: the served name of each of the engine's drafters (engine.drafters, in order):
        requests sent to that name are drafted for by that drafter; a drafter without a name drafts for every
        request."""
        self.engine = engine
        self.speculative_names = list(speculative_names or [])
        self.metrics: dict[str, RequestMetrics] = {}  # by the name requests were sent to (GET /metrics)
        self.admit = admit  # how a request enters the engine (the replica's batch window); None: at once
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.default_sampling = dict(default_sampling or {})

    # ---- completions --------------------------------------------------------------------
    async def completion_stream(self, request: CompletionRequest) -> AsyncIterator[dict]:
        prepared = self._prepare("cmpl", self._completion_prompt(request.prompt), request, request.max_tokens)
        async for chunk in self._chunks(prepared, request, _completion_choice, "text_completion"):
            yield chunk

    async def completion(self, request: CompletionRequest) -> dict:
        prepared = self._prepare("cmpl", self._completion_prompt(request.prompt), request, request.max_tokens)
        text, last, logprobs = await self._collect(prepared)
        choice = _completion_choice(text, last.finish_reason, self._completion_logprobs(logprobs))
        return self._response(prepared, "text_completion", choice, last)

    # ---- chat ---------------------------------------------------------------------------
    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict]:
        prepared = self._prepare("chatcmpl", self._chat_prompt(request), request, request.requested_max_tokens)
        chunks = self._chunks(prepared, request, _chat_choice, "chat.completion.chunk")
        # The role chunk goes out with the first content chunk, once the request is in the engine: before the
        # first byte, a full queue, a draining replica or a queue timeout is still an HTTP status (503), as for
        # completions, not an error event inside a 200 stream.
        first = await anext(chunks, None)
        yield self._chunk(prepared, "chat.completion.chunk", _chat_choice("", None, first=True))
        if first is not None:
            yield first
        async for chunk in chunks:
            yield chunk

    async def chat(self, request: ChatCompletionRequest) -> dict:
        prepared = self._prepare("chatcmpl", self._chat_prompt(request), request, request.requested_max_tokens)
        text, last, logprobs = await self._collect(prepared)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": self._chat_logprobs(logprobs), "finish_reason": last.finish_reason}
        return self._response(prepared, "chat.completion", choice, last)

    # ---- shared -------------------------------------------------------------------------
    def _prepare(self, prefix: str, prompt_ids: list[int], request: _SamplingFields, max_tokens: int | None) -> _Prepared:
        if not prompt_ids:
            raise APIError(400, "the prompt must contain at least one token", param="prompt")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)}. Shorten the prompt.",
                param="messages" if prefix == "chatcmpl" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {max_tokens}. Lower max_tokens to at most {room}.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        sampling = request.sampling_params(max_tokens or room, self.default_sampling)
        for param, ids in (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", [t for t, _ in sampling.logit_bias])):
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise APIError(400, f"{param} token ids must be in [0, {self.vocab_size}); got {outside[0]}", param=param)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        model = request.model or self.model_name
        return _Prepared(request_id, prompt_ids, sampling, int(time.time()), model, self._drafter_for(model))

    def _drafter_for(self, model: str) -> int | None:
        """The drafter serving the name a request was sent to: its own, else an unnamed one, else none."""
        names = self.speculative_names
        if model in names:
            return names.index(model)
        return names.index(None) if None in names else None

    async def _generate(self, prepared: _Prepared) -> AsyncIterator[RequestOutput]:
        request = Request(prepared.request_id, prepared.prompt_token_ids, prepared.sampling, self.eos_token_ids,
                          drafter=prepared.drafter)
        timing = RequestTiming(time.monotonic(), len(prepared.prompt_token_ids))  # ends as "abort" unless told
        try:
            async for output in self.engine.generate(request, self.admit):
                timing.tokens(time.monotonic(), len(output.new_token_ids))
                if output.finished:
                    timing.finish_reason = output.finish_reason or "stop"
                    timing.phase_times = output.phase_times or {}
                yield output
        except Exception:
            timing.finish_reason = "error"
            raise
        finally:
            timing.finish(time.monotonic(), timing.finish_reason)
            self.metrics.setdefault(prepared.model, RequestMetrics()).record(timing)

    async def _collect(self, prepared: _Prepared) -> tuple[str, RequestOutput, list[TokenLogprob] | None]:
        parts, last, logprobs = [], None, None
        async for output in self._generate(prepared):
            parts.append(output.new_text)
            last = output
            if output.logprobs:
                logprobs = (logprobs or []) + output.logprobs
        return "".join(parts), last, logprobs

    async def _chunks(self, prepared: _Prepared, request: _SamplingFields, make_choice, kind: str) -> AsyncIterator[dict]:
        last = None
        as_logprobs = self._chat_logprobs if kind.startswith("chat") else self._completion_logprobs
        async for output in self._generate(prepared):
            last = output
            # A held-back or partial character has nothing to show yet, unless its logprobs must go out.
            if output.new_text or output.finished or output.logprobs:
                choice = make_choice(output.new_text, output.finish_reason, as_logprobs(output.logprobs))
                yield self._chunk(prepared, kind, choice)
        if request.include_usage and last is not None:
            yield {**self._chunk(prepared, kind, None), "choices": [], "usage": _usage(last)}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}

    def _completion_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """Legacy completions format: parallel lists of tokens, their logprobs and top alternatives."""
        if logprobs is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chunk(self, prepared: _Prepared, kind: str, choice: dict | None) -> dict:
        chunk = {"id": prepared.request_id, "object": kind, "created": prepared.created, "model": prepared.model}
        chunk["choices"] = [choice] if choice is not None else []
        return chunk

    def _response(self, prepared: _Prepared, kind: str, choice: dict, last: RequestOutput) -> dict:
        response = self._chunk(prepared, kind, choice)
        response["usage"] = _usage(last)
        return response

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request (batched prompt lists are not supported yet)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}", param="prompt")
        return list(prompt)

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # template errors (e.g. role order) come from the model's own template
            raise APIError(400, f"the model's chat template rejected the messages: {exc}", param="messages") from exc
        # The template already wrote the special tokens it wants; do not add a second BOS.
        return self.tokenizer.encode(text, add_special_tokens=False)


def _completion_choice(text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chat_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, first: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if first else {"content": text}
    if finish_reason is not None and not text:
        delta = {}
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _usage(last: RequestOutput) -> dict:
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
    }
