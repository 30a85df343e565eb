"""Batching mode ``none``: one request at a time (the naive baseline the other modes beat).

Prefill the prompt, then decode one token per step with transformers' own KV cache. The engine
interface (add_request / abort_request / step) is the one every batching mode implements, so the
async front and the serving layer do not care which mode runs underneath.
"""

from __future__ import annotations

import collections
import logging

import torch

from app.engine.output_processor import OutputProcessor
from app.engine.request import Request, RequestOutput, RequestStatus
from app.engine.sampling import Sampler
from app.models import LoadedModel

logger = logging.getLogger(__name__)


class SerialEngine:
    def __init__(self, loaded: LoadedModel) -> None:
        self._model = loaded.model
        self._device = loaded.device
        self._sampler = Sampler()
        self._outputs = OutputProcessor(loaded.tokenizer, loaded.max_model_len)
        self._waiting: collections.deque[Request] = collections.deque()
        self._current: Request | None = None
        self._kv_cache = None  # transformers cache object of the current request
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self._waiting.append(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if self._current is not None and self._current.request_id == request_id:
            request = self._current
            self._release_current()
            return self._outputs.finish(request, RequestStatus.FINISHED_ABORTED)
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return self._outputs.finish(request, RequestStatus.FINISHED_ABORTED)
        return None

    def has_unfinished_requests(self) -> bool:
        return self._current is not None or bool(self._waiting)

    @property
    def num_running(self) -> int:
        return int(self._current is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[RequestOutput]:
        """Run one forward pass (a prefill or a one-token decode) and return its output."""
        if self._current is None:
            if not self._waiting:
                return []
            self._current = self._waiting.popleft()
            self._current.status = RequestStatus.RUNNING
        request = self._current
        try:
            token_id = self._next_token(request)
        except Exception as exc:  # one failed request must not stop the engine
            logger.exception("request %s failed", request.request_id)
            self._release_current()
            return [self._outputs.finish(request, RequestStatus.FAILED, f"{type(exc).__name__}: {exc}")]
        self.num_steps += 1
        output = self._outputs.append_token(request, token_id)
        if output.finished:
            self._release_current()
        return [output]

    def _next_token(self, request: Request) -> int:
        new_tokens = request.all_token_ids[request.num_computed_tokens :]
        input_ids = torch.tensor([new_tokens], dtype=torch.long, device=self._device)  # [1, S]
        with torch.inference_mode():
            out = self._model(input_ids=input_ids, past_key_values=self._kv_cache, use_cache=True, logits_to_keep=1)
        self._kv_cache = out.past_key_values
        request.num_computed_tokens += len(new_tokens)
        return self._sampler.sample(out.logits[:, -1, :], [request])[0]  # logits [1, V]

    def _release_current(self) -> None:
        if self._current is not None:
            self._sampler.forget(self._current.request_id)
        self._current = None
        self._kv_cache = None
