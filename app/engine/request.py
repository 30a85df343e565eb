"""Requests as counters (vLLM v1 style), their sampling parameters and their outputs."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FAILED,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FAILED: "error",
}


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI's limit): each is applied at every step
MAX_STOP_TOKEN_IDS = 1024  # stop token ids: each token is checked against them
MAX_STOP_CHARS = 1024  # characters of one stop string: the text is searched for each after every token
# Banned token sequences (vLLM's bad_words, as tokenized) and their tokens in all: each is matched at every step.
MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS = 128, 1024
# Integers a request may carry (seeds, counts): what torch and the wire formats hold, as OpenAI and vLLM bound them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it decodes greedily
# A distribution over a few token ids: (ids, probabilities), the probabilities summing to 1.
SparseProbs = tuple[list[int], list[float]]


@dataclass
class TokenLogprob:
    """Log-probability of a sampled token under the model, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    # A draft call's sampled token (SamplingParams.draft_top_n): the distribution it was drawn from.
    sampled_from: SparseProbs | None = None
    rank: int | None = None  # a prompt token's: 1 + how many tokens the model found likelier (None: not computed)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request sampling; a temperature of 0 (or below ``GREEDY_BELOW``) means greedy. Validated at construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) that ended the output stays in it
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus the n most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), as OpenAI's logit_bias
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: when given, the only tokens that can be chosen
    # vLLM's bad_words as token sequences: a sequence's last token cannot be chosen where the output ends with the rest
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # None: none; n >= 0: each prompt token's logprob (the first has none) and the n most likely alternatives.
    # The whole prompt is computed for it (no prefix-cache hit), as vLLM's prompt_logprobs.
    prompt_logprobs: int | None = None
    # Draft calls only (a draft model sampling for a target, app/spec/remote.py): sample from the n most likely
    # tokens of the processed distribution, renormalized, and return that distribution with each token.
    draft_top_n: int = 0
    # Structured outputs: an llguidance grammar (app/api/structured.py) every output must follow; None: free text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.stop = tuple([self.stop] if isinstance(self.stop, str) else self.stop or ())
        self.stop_token_ids = tuple(dict.fromkeys(self.stop_token_ids or ()))  # each once: every token checks them
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        self.logit_bias = tuple(sorted((int(token), float(value)) for token, value in bias))
        self.allowed_token_ids = tuple(sorted(set(self.allowed_token_ids or ())))
        self.bad_words_token_ids = tuple(dict.fromkeys(tuple(word) for word in self.bad_words_token_ids or ()))
        if self.top_k == -1:
            self.top_k = 0
        checks = [  # (holds, the field, what it must be)
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0 (0 or -1 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty", "repetition_penalty must be in [0.01, 100]"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", f"seed must be in [{INT64_MIN}, {INT64_MAX}]"),
            (all(INT64_MIN <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be 64-bit integers"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be in [0, max_tokens]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings are supported"),
            # what each token and step checks or applies: bounded, so that one request cannot slow its batch's steps
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop", f"stop strings are at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, as OpenAI's does"),
            (all(0 <= t <= INT64_MAX for t in self.allowed_token_ids), "allowed_token_ids",
             "allowed_token_ids must be token ids (>= 0)"),
            (all(self.bad_words_token_ids), "bad_words", "each bad word must be at least one token"),
            (len(self.bad_words_token_ids) <= MAX_BAD_WORDS, "bad_words",
             f"at most {MAX_BAD_WORDS} bad words, as tokenized (a word can count twice: alone and after a space)"),
            (sum(map(len, self.bad_words_token_ids)) <= MAX_BAD_WORDS_TOKENS, "bad_words",
             f"bad words hold at most {MAX_BAD_WORDS_TOKENS} tokens in all"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "logprobs",
             f"prompt logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.draft_top_n >= 0, "draft_top_n", "draft_top_n must be >= 0"),
            (all(INT64_MIN <= t <= INT64_MAX and -100 <= v <= 100 for t, v in self.logit_bias), "logit_bias",
             "logit_bias maps token ids to biases in [-100, 100]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # as vLLM: a temperature below its epsilon is greedy decoding

    def allowed_index(self, device: Any) -> Any:
        """allowed_token_ids as a sorted index tensor on ``device``, made once: every step of the request applies it."""
        import torch

        cached = self.__dict__.setdefault("_allowed_index", {})  # not a field: never compared, nor copied by replace
        if device not in cached:
            cached[device] = torch.tensor(self.allowed_token_ids, dtype=torch.long, device=device)
        return cached[device]


@dataclass
class Request:
    """A generation request as the engine sees it: token counters plus a status."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it (EOS: None)
    group: int = 0  # admission group (one @serve.batch window); dynamic batching runs a group to completion
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    # Draft tokens to verify in the next step, after the last output token (speculative decoding): the step
    # computes them too, and keeps those the target model agrees with (app/spec/, engine.py). Set by set_drafts.
    spec_token_ids: list[int] = field(default_factory=list)
    # The distribution each draft token was sampled from (a draft model sampling for a sampled request);
    # None: the drafts were chosen, not sampled (n-gram lookup, greedy drafts), and are verified as one-hot.
    spec_draft_probs: list[SparseProbs] | None = None
    # Which of the engine's drafters (engine.drafters) drafts for it (None: none); by default the first, if any.
    drafter: int | None = 0
    awaiting_draft: bool = False  # its next drafts are being computed elsewhere: the scheduler lets it wait
    detokenize: bool = True  # False: token ids only (a draft model's proposals need no text)
    # Requests of one session (a draft model's calls for one target sequence) hand their KV on: the next one
    # keeps what it shares with the last and recomputes only the rest (kv_cache.py: sessions).
    session_id: str | None = None
    # vLLM's cache_salt: its prompt's KV is shared through the prefix cache only with requests of the same salt (a
    # tenant's requests cannot learn from their timing which prompts another tenant sent)
    cache_salt: str | None = None
    first_scheduled_s: float | None = None  # monotonic: first admitted to a step (the end of its queue time)
    # sampling.prompt_logprobs: the logprob of each prompt token computed so far (the first token's is None)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    first_token_s: float | None = None  # monotonic: its first token was sampled (the end of its prefill)
    matcher: Any = None  # sampling.grammar's state, made at admission in the engine (app/engine/grammar.py)

    def phase_times(self, now: float) -> dict[str, float]:
        """Queue, prefill and decode time so far (seconds), for the metrics; phases not reached are absent."""
        times: dict[str, float] = {}
        if self.first_scheduled_s is not None:
            times["queue_s"] = self.first_scheduled_s - self.arrival_time
            if self.first_token_s is not None:
                times["prefill_s"] = self.first_token_s - self.first_scheduled_s
                times["decode_s"] = now - self.first_token_s
        return times

    def set_drafts(self, token_ids: list[int], probs: list[SparseProbs] | None = None) -> None:
        """The drafts for the next step, with the distributions they were sampled from (if they were)."""
        if probs is not None and len(probs) != len(token_ids):
            raise ValueError(f"{len(probs)} draft distributions for {len(token_ids)} draft tokens")
        self.spec_token_ids, self.spec_draft_probs = token_ids, probs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class RequestOutput:
    """What one engine step produced for one request: deltas plus running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    stop_reason: int | str | None = None  # on the finishing output: Request.stop_reason
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when the request asked for them
    phase_times: dict[str, float] | None = None  # on the finishing output: Request.phase_times
    steps: int = 1  # the engine steps it holds (a paced stream's chunk folds several)

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """This delta and the request's next one as one delta: both deltas' tokens, the later one's totals and status."""
        logprobs = (self.logprobs or []) + (later.logprobs or []) if self.logprobs or later.logprobs else None
        return dataclasses.replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids, new_text=self.new_text + later.new_text, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs, steps=self.steps + later.steps,
        )
