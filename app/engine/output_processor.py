"""Turns each sampled token into a RequestOutput: stop conditions, detokenization, finish reasons.

Shared by every batching mode, so all modes stop and detokenize identically.
"""

from __future__ import annotations

import time

from app.engine.detokenizer import IncrementalDetokenizer, special_token_ids
from app.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._special_ids = special_token_ids(tokenizer)  # once: every request's detokenizer skips them
        self._max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def append_token(self, request: Request, token_id: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        """Record one new token of ``request`` and decide whether it finished."""
        detokenizer = self._detokenizer(request) if request.detokenize else None
        params = request.sampling
        request.output_token_ids.append(token_id)
        if request.first_token_s is None:
            request.first_token_s = time.monotonic()
        text = ""
        if token_id in params.stop_token_ids or (token_id in request.eos_token_ids and not params.ignore_eos):
            request.status = RequestStatus.FINISHED_STOPPED  # the stop token's own text is output only if asked
            request.stop_reason = token_id if token_id in params.stop_token_ids else None  # EOS: None, as vLLM
            if request.detokenize and params.include_stop_str_in_output:
                text, _ = detokenizer.add_token(token_id, check_stop=False)
        elif request.detokenize:
            past_min = request.num_output_tokens > params.min_tokens  # as stop tokens: the first after min_tokens may stop
            text, hit_stop = detokenizer.add_token(token_id, check_stop=past_min)
            if hit_stop:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = detokenizer.stopped_by
        if not request.status.finished and (
            request.num_output_tokens >= params.max_tokens
            or request.num_prompt_tokens + request.num_output_tokens >= self._max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.status.finished:
            text += detokenizer.flush() if request.detokenize else ""
            self.forget(request.request_id)
        output = _output(request, [token_id], text)
        output.logprobs = [logprob] if logprob is not None else None
        if request.num_output_tokens == 1 and request.sampling.prompt_logprobs is not None:
            output.prompt_logprobs = list(request.prompt_logprobs)
        return output

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> RequestOutput:
        """End a request without a new token (aborted or failed)."""
        request.status = status
        request.error = error
        self.forget(request.request_id)
        return _output(request, [], "")

    def forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids, request.sampling.stop, request.sampling.skip_special_tokens,
                request.sampling.include_stop_str_in_output, self._special_ids,
            )
            self._detokenizers[request.request_id] = detokenizer
        return detokenizer


def _output(request: Request, new_token_ids: list[int], text: str) -> RequestOutput:
    finished = request.status.finished
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_text=text,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        finished=finished,
        finish_reason=request.status.finish_reason,
        error=request.error,
        stop_reason=request.stop_reason if finished else None,
        phase_times=request.phase_times(time.monotonic()) if finished else None,
    )
