"""OpenAI completions and chat over an AsyncEngine: tokenize, validate, stream chunks, aggregate.

Pure Python (no ray): the model replica deployment hosts one OpenAIServing per model. Streaming
methods are async generators that yield OpenAI chunk dicts; validation and admission to the engine happen
before the first yield, so a bad request or a full queue fails on the first ``__anext__`` and the caller can
still answer with a proper HTTP status. An OpenAI request with several prompts or choices is several engine
requests (``fanout.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from typing import AsyncIterator

from app.api import budget, extras, legacy_functions, reasoning, tool_streams, tools
from app.api.errors import APIError
from app.api.fim import fim_prompt
from app.api.fanout import (Prepared, best_candidates, drafter_for, fan_out, gather_or_cancel, hold_room, merged, num_prompts,
                            still_accepting, usage)
from app.api.logprobs import LogprobFormatter, next_text_offset
from app.api.messages import assistant_message
from app.api.prompts import Prompts
from app.api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from app.api.token_requests import DetokenizeRequest, TokenizeRequest
from app.api.structured import request_format
from app.engine import AsyncEngine, Request, RequestOutput
from app.engine.request import TokenLogprob
from app.engine.async_engine import Admit
from app.engine.errors import EngineQueueTimeoutError
from app.metrics import RequestMetrics, RequestTiming


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
        tool_parser: str = "hermes",
        reasoning_parser: str | None = None,
    ) -> None:
        """``speculative_names``: the served name of each of the engine's drafters (engine.drafters, in order):
        requests sent to that name are drafted for by that drafter; a drafter without a name drafts for every
        request."""
        self.engine = engine
        self.speculative_names = list(speculative_names or [])
        self.metrics = {name: RequestMetrics() for name in [model_name, *filter(None, self.speculative_names)]}  # at 0 first
        self.admit = admit  # how a request enters the engine (the replica's batch window); None: at once
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.default_sampling = dict(default_sampling or {})
        self.logprob_format = LogprobFormatter(tokenizer)
        self.tool_parser = tool_parser  # how "auto" tool calls are read out of this model's text (app/api/tools.py)
        self.reasoning_parser = reasoning_parser  # whether <think>...</think> is the message's reasoning (reasoning.py)
        # markers the tokenizer calls special would leave the text under skip_special_tokens: such requests keep them
        self._think_is_special = bool(reasoning_parser) and reasoning.is_special(tokenizer)
        self.prompts = Prompts(tokenizer, model_name, max_model_len, vocab_size)  # requests' token ids

    # ---- completions --------------------------------------------------------------------
    async def completion_stream(self, request: CompletionRequest) -> AsyncIterator[dict]:
        plans = await asyncio.to_thread(self._completion_plans, request)  # tokenizing: off the event loop
        # closed with this stream (a client gone), not when collected: its engine requests are aborted at once
        async with contextlib.aclosing(self._streamed(plans, request, _completion_choice, "text_completion")) as chunks:
            async for chunk in chunks:
                yield chunk

    async def completion(self, request: CompletionRequest) -> dict:
        plans = await asyncio.to_thread(self._completion_plans, request)  # tokenizing: off the event loop
        results = await self._collected(plans)
        ranked = len(plans) > request.n * num_prompts(plans)
        kept = best_candidates(plans, results, request.n) if ranked else list(zip(plans, results))
        shown = request.logprobs is not None  # best_of computed them for ranking only

        def answer() -> dict:
            choices = [{**_completion_choice((p.echo or "") + text, last.finish_reason,
                                             self._echoed_logprobs(lps, p, 0, p.logprobs_as_ids) if shown else None,
                                             index), "stop_reason": last.stop_reason}
                       for index, (p, (text, last, lps)) in enumerate(kept)]
            extras.add_to_completion_choices(choices, [p for p, _ in kept], request, self.logprob_format)
            return self._response(plans, "text_completion", choices)

        return await _formatted(answer, shown or request.prompt_logprobs is not None)

    # ---- chat ---------------------------------------------------------------------------
    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict]:
        choice, kind = request.tool_choice_resolved(), "chat.completion.chunk"
        # the template and tokenizing off the event loop, where every stream of this replica waits (75 ms for 40k tokens)
        plans = await asyncio.to_thread(self._chat_plans, request)

        def choice_chunks(plan: Prepared) -> AsyncIterator[dict]:  # the reasoning apart, where the model's parser splits it
            plain = self._chunks(plan, _chat_choice, kind, request)
            if plan.reasoning_inside is None:
                return plain
            return reasoning.reasoned_chunks(plain, plan.reasoning_inside, plan.reasoning_shown, plan.call_ends_thinking)

        if choice == "auto":  # content as it comes, calls once their text is whole
            one_call = request.parallel_tool_calls is False
            streamed = self._streamed(plans, request, _chat_choice, kind, chunker=lambda plan:
                                      tool_streams.auto_chunks(choice_chunks(plan), self.tool_parser, one_call, request.parsed_tools()))
        elif isinstance(choice, tools.Tool):  # a named function: its arguments as they come
            streamed = self._streamed(plans, request, _chat_choice, kind, chunker=lambda plan:
                                      tool_streams.named_call_chunks(choice_chunks(plan), choice.name))
        elif choice is not None:  # required: each call once its name is whole, then its arguments as they come
            streamed = self._streamed(plans, request, _chat_choice, kind, chunker=lambda plan:
                                      tool_streams.required_call_chunks(choice_chunks(plan)))
        else:
            streamed = self._streamed(plans, request, _chat_choice, kind, chunker=choice_chunks)
        if request._legacy_functions:  # the deprecated functions: each call fragment as delta.function_call
            streamed = legacy_functions.chunks(streamed)
        async with contextlib.aclosing(streamed) as chunks:  # closed with this stream, as completion_stream's
            async for chunk in chunks:
                yield chunk

    async def chat(self, request: ChatCompletionRequest) -> dict:
        plans = await asyncio.to_thread(self._chat_plans, request)  # the template and tokenizing: off the loop
        results = await self._collected(plans)
        choice = request.tool_choice_resolved()
        one_call = request.parallel_tool_calls is False
        shown = request.parsed_tools()

        def answer() -> dict:
            choices = [{"index": p.index,
                        "message": assistant_message(p, text, choice, self.tool_parser, one_call, shown, last.finish_reason),
                        "logprobs": self.logprob_format.chat(lps, p.logprobs_as_ids), "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason}
                       for p, (text, last, lps) in zip(plans, results)]
            for entry, p in zip(choices, plans):
                if p.echo:  # vLLM's echo: the assistant message continued
                    entry["message"]["content"] = p.echo + (entry["message"]["content"] or "")
            for entry in choices:  # a forced function's answer stops as any answer does (OpenAI, vLLM); the model's own calls
                if choice in ("auto", "required") and entry["message"].get("tool_calls") and entry["finish_reason"] == "stop":
                    entry["finish_reason"] = "tool_calls"
            response = self._response(plans, "chat.completion", choices)
            extras.add_to_chat_response(response, plans, request, self.logprob_format)
            return legacy_functions.answer(response) if request._legacy_functions else response

        return await _formatted(answer, request.logprobs or request.prompt_logprobs is not None)

    @functools.cached_property
    def _call_is_special(self) -> bool:
        """Whether this model's call marker is a special token, which the text its calls are read from must keep."""
        return self.tool_parser in ("hermes", "qwen3_coder") and tools.marker_is_special(self.tokenizer)

    # ---- one OpenAI request, several engine requests (app/api/fanout.py) -------------------
    def _chat_plans(self, request: ChatCompletionRequest) -> list[Prepared]:
        text = self.prompts.chat_text(request)
        prompt_ids = self.prompts.encoded_chat(text, request)
        if request._fit_by_dropping_oldest:  # a response's truncation: auto; room for its answer (up to half the context)
            reserve = min(request.requested_max_tokens or 1, self.max_model_len // 2)
            if len(prompt_ids) + reserve > self.max_model_len:
                prompt_ids = self.prompts.fitted_chat(request, self.max_model_len - reserve)
        prompt_ids = extras.truncated(prompt_ids, request.truncate_prompt_tokens, request.truncation_side, self.max_model_len)
        bad_words = extras.bad_words_token_ids(self.tokenizer, request.bad_words)
        prepared = self._prepare("chatcmpl", prompt_ids, request, request.requested_max_tokens, bad_words)
        prepared.echo = extras.echoed_turn(request)  # sent before the answer, never read as part of it
        if (self.tool_parser == "mistral" or self._call_is_special) and request.tool_choice_resolved() == "auto":
            prepared.sampling = dataclasses.replace(prepared.sampling, skip_special_tokens=False)  # the marker kept, as vLLM
        if request.tool_choice_resolved() == "auto":
            grammar = self._auto_grammar(request)
            if grammar is not None:
                prepared.sampling = dataclasses.replace(prepared.sampling, grammar=grammar)
        if not request.include_reasoning and not self.reasoning_parser:  # its thinking would stay in the text
            raise APIError(400, f"include_reasoning: false needs a reasoning parser, which model {self.model_name!r} is not "
                           "served with (model.reasoning_parser)", param="include_reasoning")
        prepared.reasoning_shown = request.include_reasoning
        prepared.reasoning_inside = reasoning.answer_starts_inside(self.reasoning_parser, request,
                                                                   lambda: self.prompts.turn_opening(request, text))
        prepared.call_ends_thinking = reasoning.call_ends_thinking(self.reasoning_parser, self.tool_parser, request, prepared)
        if prepared.reasoning_inside is not None and prepared.sampling.grammar is not None:  # the format after the thinking
            grammar = reasoning.after_thinking(prepared.sampling.grammar, self.tokenizer, prepared.reasoning_inside)
            prepared.sampling = dataclasses.replace(prepared.sampling, grammar=grammar)
        if prepared.reasoning_inside is not None and self._think_is_special:
            prepared.sampling = dataclasses.replace(prepared.sampling, skip_special_tokens=False)
        return self._fan_out([prepared], request.n)

    def _auto_grammar(self, request: ChatCompletionRequest) -> str | None:
        """``tool_choice: auto``'s grammar, if any: beside a response format, the format holds the answer and each call
        its tool's schema; else where a tool is strict, the text is free and calls follow their schemas."""
        found_format = request_format(request.response_format, request.structured_outputs)
        parallel = request.parallel_tool_calls is not False
        if found_format is not None:
            return tools.answer_or_calls(found_format, request.parsed_tools(), self.tool_parser, parallel, self.tokenizer)
        return tools.strict_calls(request.parsed_tools(), self.tool_parser, parallel, self.tokenizer)

    def _completion_plans(self, request: CompletionRequest) -> list[Prepared]:
        prompt = fim_prompt(self.tokenizer, request.prompt, request.suffix, self.model_name) if request.suffix else request.prompt
        whole = self.prompts.completion(prompt, request.add_special_tokens)
        prompts = [extras.truncated(ids, request.truncate_prompt_tokens, request.truncation_side, self.max_model_len)
                   for ids in whole]
        candidates = request.best_of or request.n  # prompts x candidates: bounded at parse, then by the replica (fan_out)
        bad_words = extras.bad_words_token_ids(self.tokenizer, request.bad_words)  # once for all the prompts
        prepared = [self._prepare("cmpl", ids, request, request.max_tokens, bad_words) for ids in prompts]
        if request.echo:
            texts = request.prompt if isinstance(request.prompt, list) and isinstance(request.prompt[0], str) else (
                [request.prompt] if isinstance(request.prompt, str) else [self.tokenizer.decode(ids) for ids in prompts])
            texts = [text if len(ids) == len(full) else self.tokenizer.decode(ids)  # what the model read, once truncated
                     for text, ids, full in zip(texts, prompts, whole)]
            prepared = [dataclasses.replace(p, echo=text) for p, text in zip(prepared, texts)]
        if candidates > request.n:  # best_of ranks candidates by their tokens' log-probability
            prepared = [dataclasses.replace(p, sampling=dataclasses.replace(p.sampling, logprobs=p.sampling.logprobs or 0))
                        for p in prepared]
        return self._fan_out(prepared, candidates, request.n)

    def _fan_out(self, prepared: list[Prepared], count: int, n: int | None = None) -> list[Prepared]:
        return fan_out(prepared, count, n, getattr(self.engine, "capacity", None))

    async def _streamed(self, plans: list[Prepared], request: _SamplingFields, make_choice, kind: str,
                        chunker=None) -> AsyncIterator[dict]:
        """Every choice's chunks as they come, then the usage chunk (if asked). Nothing is sent before the engine
        has the request: a full queue, a draining replica or a queue timeout is still an HTTP status (503), as for
        completions, not an error event inside a 200 stream. A chat stream's role chunks go out with the first
        content chunk."""
        reservation = hold_room(self.engine, self.metrics_for(plans[0].model), plans)
        chunker = chunker or (lambda plan: self._chunks(plan, make_choice, kind, request))
        streams = merged([chunker(p) for p in plans]) if len(plans) > 1 else None
        chunks = chunker(plans[0]) if streams is None else (chunk async for _, chunk in streams)
        try:
            first = await anext(chunks, None)
            if kind.startswith("chat"):
                for p in plans:
                    opening = self._chunk(p, kind, _chat_choice("", None, first=True, index=p.index))
                    if request.return_token_ids and p is plans[0]:  # vLLM's: the prompt's ids in the first chunk
                        opening["prompt_token_ids"] = p.prompt_token_ids
                    if request.continuous_usage:
                        opening["usage"] = extras.choice_usage(p, 0)
                    yield opening
                    if p.echo:  # vLLM's echo: the assistant message continued, as a chunk of its own
                        yield {**self._chunk(p, kind, _chat_choice(p.echo, None, index=p.index)),
                               **({"usage": opening["usage"]} if request.continuous_usage else {})}
            if first is not None:
                yield first
                async for chunk in chunks:
                    yield chunk
        finally:  # a client gone: its engine requests are aborted now, not when collected
            reservation.release()
            await chunks.aclose()
            if streams is not None:
                await streams.aclose()  # closing the expression around it does not close it
        if request.include_usage:
            yield {**self._chunk(plans[0], kind, None), "usage": reasoning.usage_with_thinking(usage(plans), plans, self.tokenizer)}

    # ---- shared -------------------------------------------------------------------------
    def _prepare(self, prefix: str, prompt_ids: list[int], request: _SamplingFields, max_tokens: int | None,
                 bad_words: tuple[tuple[int, ...], ...] = ()) -> Prepared:
        room = budget.room_left(prompt_ids, self.vocab_size, self.max_model_len, "messages" if prefix == "chatcmpl" else "prompt")
        max_tokens = budget.capped_max_tokens(max_tokens, room, request, self.max_model_len, self.default_sampling.get("max_tokens"))
        prompt_only = max_tokens == 0
        sampling = request.sampling_params(1 if prompt_only else max_tokens, self.default_sampling, bad_words)
        budget.check_token_ids(sampling, self.vocab_size, self.eos_token_ids)
        request_id = f"{prefix}-{uuid.uuid4().hex}"  # the engine's: unique whatever id a client sends
        response_id = f"{prefix}-{request.request_id}" if request.request_id else request_id
        model = request.model or self.model_name
        return Prepared(request_id, prompt_ids, sampling, int(time.time()), model, drafter_for(self.speculative_names, model),
                        response_id, prompt_only=prompt_only, logprobs_as_ids=request.return_tokens_as_token_ids,
                        cache_salt=request.cache_salt)

    async def _collected(self, plans: list[Prepared]) -> list:
        """Every plan's answer (``_collect``), their places held until each starts (fanout.hold_room)."""
        reservation = hold_room(self.engine, self.metrics_for(plans[0].model), plans)
        try:
            return await gather_or_cancel([self._collect(p) for p in plans])
        finally:
            reservation.release()

    async def _generate(self, prepared: Prepared) -> AsyncIterator[RequestOutput]:
        request = Request(prepared.request_id, prepared.prompt_token_ids, prepared.sampling, self.eos_token_ids,
                          drafter=prepared.drafter, cache_salt=prepared.cache_salt)
        metrics = self.metrics_for(prepared.model)
        still_accepting(self.engine, metrics, prepared)
        prompt_tokens = len(prepared.prompt_token_ids) if prepared.first_of_prompt else 0
        timing = RequestTiming(time.monotonic(), prompt_tokens, metrics)  # ends as "abort" unless told
        timed_out = False
        prepared.token_ids = []  # its own: fan_out's copies of one plan would share a list made before
        try:
            async for output in self.engine.generate(request, self.admit, prepared.reservation):
                if prepared.prompt_only:
                    output = dataclasses.replace(output, new_token_ids=[], new_text="", num_output_tokens=0, stop_reason=None,
                                                 logprobs=None if output.logprobs is None else [],
                                                 finish_reason="length" if output.finish_reason == "stop" else output.finish_reason)
                prepared.last = output
                prepared.token_ids.extend(output.new_token_ids)
                prepared.prompt_logprobs = prepared.prompt_logprobs or output.prompt_logprobs
                timing.tokens(time.monotonic(), len(output.new_token_ids), output.steps)
                if output.finished:
                    timing.finish_reason = output.finish_reason or "stop"
                    timing.phase_times = output.phase_times or {}
                yield output
        except EngineQueueTimeoutError:
            timed_out = True  # overload, not a failure: never served, as a request turned away at the door
            raise
        except Exception as exc:
            timing.finish_reason = "error"
            timing.phase_times = getattr(exc, "phase_times", None) or {}  # a failure in the engine carries them
            raise
        finally:
            timing.finish(time.monotonic(), timing.finish_reason)
            if timed_out:
                metrics.record_queue_timeout(timing.end_s - timing.arrival_s)
            else:
                metrics.record(timing)

    def metrics_for(self, model: str) -> RequestMetrics:
        """The figures of requests sent to ``model``: under that name where this model serves it, else the model's
        own (a handle call naming something else is answered; its name must not grow the metrics)."""
        return self.metrics[model if model in self.speculative_names else self.model_name]  # each made at start

    async def _collect(self, prepared: Prepared) -> tuple[str, RequestOutput, list[TokenLogprob] | None]:
        parts, last, logprobs = [], None, None
        async for output in self._generate(prepared):
            parts.append(output.new_text)
            last = output
            if output.logprobs is not None:
                logprobs = (logprobs or []) + output.logprobs
        return "".join(parts), last, logprobs

    async def _chunks(self, prepared: Prepared, make_choice, kind: str, request: _SamplingFields) -> AsyncIterator[dict]:
        """One choice's chunks. vLLM's ``return_token_ids``: each carries its tokens' ids, a completion's first its
        prompt's; vLLM's ``continuous_usage_stats``: each carries its choice's usage so far."""
        chat, token_ids = kind.startswith("chat"), request.return_token_ids
        prompt_ids = None if chat or not token_ids else prepared.prompt_token_ids
        echo = None if chat else prepared.echo  # a completion's first chunk: the prompt (and its logprobs), then the answer
        text_offset = 0  # completions: each chunk's token offsets continue the chunks' before it
        async for output in self._generate(prepared):
            # A chunk for every output that carries a token, as vLLM streams: a token with no text of its own (a
            # special token left out of the text, a partial character, text held back for a stop string) goes out
            # as an empty delta, so a client sees each token as it comes and can count them.
            if output.new_token_ids or output.new_text or output.finished or output.logprobs or echo is not None:
                if chat:
                    logprobs = self.logprob_format.chat(output.logprobs, prepared.logprobs_as_ids)
                else:
                    # an echoed prompt's (5.4k tokens with 20 alternatives each: ~0.9 s) off the loop, where every stream waits
                    logprobs = await asyncio.to_thread(self._echoed_logprobs, output.logprobs, prepared, text_offset,
                                                       prepared.logprobs_as_ids) if echo is not None else \
                        self.logprob_format.completion(output.logprobs, text_offset=text_offset, as_ids=prepared.logprobs_as_ids)
                    text_offset = next_text_offset(logprobs, text_offset)
                choice = make_choice((echo or "") + output.new_text, output.finish_reason, logprobs, index=prepared.index)
                if output.finished:  # vLLM's: the stop token id or string that ended the answer (else null)
                    choice["stop_reason"] = output.stop_reason
                echo = None
                if token_ids:
                    choice["token_ids"] = list(output.new_token_ids)
                    if prompt_ids is not None:
                        choice["prompt_token_ids"], prompt_ids = prompt_ids, None
                chunk = self._chunk(prepared, kind, choice)
                if request.continuous_usage:
                    chunk["usage"] = extras.choice_usage(prepared, output.num_output_tokens)
                yield chunk

    def _echoed_logprobs(self, logprobs: list[TokenLogprob] | None, echoed: Prepared, text_offset: int, as_ids: bool):
        return self.logprob_format.completion(logprobs, echoed.prompt_token_ids, echoed.prompt_logprobs, text_offset,
                                              echoed.sampling.logprobs, as_ids)

    def _chunk(self, prepared: Prepared, kind: str, choice: dict | None) -> dict:
        chunk = {"id": prepared.response_id, "object": kind, "created": prepared.created, "model": prepared.model}
        chunk["choices"] = [choice] if choice is not None else []
        return chunk

    def _response(self, plans: list[Prepared], kind: str, choices: list[dict]) -> dict:
        response = self._chunk(plans[0], kind, None)
        response["choices"], response["usage"] = choices, reasoning.usage_with_thinking(usage(plans), plans, self.tokenizer)
        return response

    # ---- tokens (vLLM's /tokenize and /detokenize): the prompts' reading ---------------------------
    async def tokenize(self, request: TokenizeRequest) -> dict:
        return await self.prompts.tokenize(request)

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        return await self.prompts.detokenize(request)


async def _formatted(answer, with_logprobs: bool) -> dict:
    """``answer()``, off the event loop where it formats logprobs: an echoed 8k-token prompt's with 20 alternatives each
    took 1 s, while every stream of the replica waited."""
    return await asyncio.to_thread(answer) if with_logprobs else answer()


def _completion_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _chat_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, first: bool = False,
                 index: int = 0) -> dict:
    delta = {"role": "assistant", "content": ""} if first else {"content": text}
    if finish_reason is not None and not text:
        delta = {}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
