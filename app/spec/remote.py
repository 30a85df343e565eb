"""Drafts from a draft model served elsewhere (``drafter: model``): asked for without waiting, matched on arrival.

The target's engine runs on its own thread and never blocks on a draft. After each step it decides, per
decoding sequence, what to verify next (:meth:`ModelDrafter.propose`) and queues :class:`DraftCall` s that
the serving side sends to the draft model's replica (``ModelServer.propose`` there); each answer comes
back as a :class:`DraftResult` (:meth:`ModelDrafter.add_result`).

What overlaps with what: when a sequence enters a step with drafts ``d1..dk``, it asks at once for the
window after them, assuming the target keeps all of them: context + ``d1..dk``, ``k + 1`` tokens (the
first is the draft's guess of the target's bonus token). So the draft replica drafts window i+1 while the
target verifies window i; when the target keeps everything and its bonus token is the draft's guess,
window i+1 is ready (or nearly) when step i ends. After a rejection, the pre-drafted window is dropped and
the sequence asks again from where it stands; it then waits (it is not scheduled; the rest of the batch
goes on) for at most ``max_draft_wait_ms``, after which it decodes a token without drafts.

Matching, and why any arrival is safe to use: a result says "after output O, the draft model proposes
t1..tn". When it arrives the sequence's output is O'. If O' = O + t1..tm (the target emitted exactly what
the draft guessed so far), t(m+1).. are proposals for O'; otherwise they are dropped. For a greedy request
the draft proposes its greedy choice under the request's penalties, verified as one-hot drafts. For a
sampled request it samples each token from its own processed distribution (the request's temperature,
top-k/p, min-p and penalties, cut to its ``DRAFT_TOP_N`` most likely tokens) and returns that distribution
q with it; the target accepts with probability min(1, p/q) (``rejection.py``). Either way the draft never
sees the target's random draws, and whether a proposal is used depends only on tokens before it: given
those, t(m+1) is still a draw from q after O', so output is lossless whatever the timing, a lost call,
or which replica answered.

State that survives routing: the draft replica keeps a sequence's KV from call to call under its id, rolled
back to what the next call's context shares (``Request.session_id``, app/engine/kv_cache.py), and every call
carries the sequence's whole context (prompt and output), so a draft replica that never saw the sequence,
or a restarted one, recomputes it. A failed call makes the drafter stand down for a while (the draft
replica is being replaced): sequences decode without drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from app.config import SpecConfig
from app.engine.request import Request, SamplingParams, SparseProbs
from app.spec.policy import PRIOR_AFTER_DRAFTS, DraftLengthPolicy, DraftPolicyConfig, StepCosts
from app.spec.stats import SpecDecodingStats

_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # pause after 1, 2, 3, 4+ consecutive failed calls
_FIRST_PRIOR = 0.8  # a draft model of the target's family agrees on most tokens (until measured otherwise)
# Sequence-steps between probes while drafting cannot pay at the measured cost. A probe's prefill on the draft
# replica competes with the target for a small machine's cores (one cost ~0.4 s of a 2-core EPYC's target time).
_PROBE_HOPELESS_EVERY = 4096
# A sampled request's draft tokens are drawn from the draft's distribution cut to its most likely tokens, which
# travels with them: ~1 KB per token instead of the vocabulary, at the cost of the (small) mass cut off.
DRAFT_TOP_N = 64


@dataclass(frozen=True)
class DraftCall:
    """Ask the draft model for ``num_tokens`` proposals after ``prompt + output`` (plain data: crosses Ray)."""

    call_id: int
    drafter: int  # which of the target engine's drafters asks (engine.drafters index)
    sequence_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the output the draft assumes (the target's, plus drafts assumed kept)
    num_tokens: int
    sampling: SamplingParams  # the request's own: penalties and min_tokens shape the draft's choice too
    cache_salt: str | None = None  # the request's: the draft model's prefix cache is salted alike


@dataclass(frozen=True)
class DraftResult:
    call_id: int
    drafter: int
    sequence_id: str
    token_ids: list[int]  # the proposals (empty on failure, or when the draft model could not draft)
    elapsed_s: float = 0.0  # the call's round trip, as the target side measured it
    error: str | None = None
    s_per_token: float | None = None  # the draft model's own time per proposal after the first (no prefill, no queue)
    probs: list[SparseProbs] | None = None  # sampled proposals: the distribution each was drawn from


def draft_sampling(sampling: SamplingParams, num_output_tokens: int, num_tokens: int) -> SamplingParams:
    """The draft model's sampling for a call: the request's own (penalties, min_tokens, temperature, top-k/p,
    min-p), greedy for a greedy request, else cut to its ``DRAFT_TOP_N`` most likely tokens; never the request's
    seed (the draft's draws must not follow the target's) and none of its stop strings or logprobs (prompt logprobs
    would cost the draft model its prefix cache and a whole prompt's logits, for nothing)."""
    max_tokens = num_output_tokens + num_tokens
    return dataclasses.replace(
        sampling, seed=None, stop=(), logprobs=None, prompt_logprobs=None, max_tokens=max_tokens,
        min_tokens=min(sampling.min_tokens, max_tokens),
        draft_top_n=0 if sampling.greedy else DRAFT_TOP_N,
    )


@dataclass
class _Sequence:
    asked_id: int | None = None  # the newest call in flight
    asked_base: list[int] | None = None  # the output that call assumes
    arrived_base: list[int] | None = None  # the newest answer: proposals after this output ...
    arrived: list[int] | None = None  # ... these
    arrived_probs: list[SparseProbs] | None = None  # ... drawn from these (sampled proposals)
    waiting_since: float | None = None
    answered: int = 0  # calls answered so far
    exhausted: bool = False  # the draft model answered nothing (its context is full): stop asking
    want: int = 0  # how many of the newest call's proposals to verify when they arrive


class ModelDrafter:
    """One target engine's drafts from one draft model: policy, counters, calls out, results in."""

    def __init__(self, index: int, config: SpecConfig, max_model_len: int, step_costs: StepCosts | None = None,
                 vocab_size: int | None = None) -> None:
        self.index = index
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # the target's: a proposal past it cannot even be fed to the target
        # A draft model costs a good part of a target step per token: a sequence starts speculating only where its
        # prior (this drafter's acceptance so far) says it pays, and waits for a window it does not have yet.
        policy = DraftPolicyConfig(num_speculative_tokens=config.num_speculative_tokens, saturation_tokens=config.saturation_tokens,
                                   start_from_prior=True, prior_acceptance=_FIRST_PRIOR, adaptive=config.adaptive)
        self.policy = DraftLengthPolicy(policy, step_costs)
        self.stats = SpecDecodingStats.new(config.num_speculative_tokens)
        self._seqs: dict[str, _Sequence] = {}
        self._calls: list[DraftCall] = []
        self._ids = itertools.count()
        self._failures = 0
        self._paused_until = 0.0
        self._hopeless_steps = 0
        # the draft model's time per proposal (EMA): as its server measures it, else the round trip per proposal
        self.draft_s_per_token: float | None = None

    # ---- the engine's side ---------------------------------------------------------------------
    def propose(self, request: Request, limit: int, batch_size: int, target_step_s: float, now: float) -> None:
        """Give ``request`` its drafts for the next step (maybe none), and ask for those it will want after."""
        if self.draft_s_per_token is not None and target_step_s > 0:  # c, from the two measured averages
            self.policy.cost_ratio = self.draft_s_per_token / target_step_s
        seq = self._seqs.setdefault(request.request_id, _Sequence())
        drafts, probs = self._usable(seq, request.output_token_ids)
        request.set_drafts([])
        request.awaiting_draft = False
        if limit <= 0 or now < self._paused_until or seq.exhausted:
            seq.waiting_since = None
            return
        if drafts and seq.want:  # what was asked for (a probe's too) is verified; the policy sizes the next window
            n = min(seq.want, limit)
            request.set_drafts(drafts[:n], probs[:n] if probs is not None else None)
            seq.waiting_since = None
            k = min(limit, self._length(request, batch_size))
            if self.config.draft_ahead and k > 0:  # the overlap: draft the next window while the target verifies this one
                self._ask(request, request.output_token_ids + request.spec_token_ids, k + 1, want=k)
            return
        k = min(limit, self._length(request, batch_size))
        if k == 0:
            seq.waiting_since = None
            if self._probe_due():  # nobody waits for it: its answer measures the draft's cost (and is used if it fits)
                self._ask(request, list(request.output_token_ids), self.config.num_speculative_tokens, want=limit)
            return
        if not _extends(request.output_token_ids, seq.asked_base):
            self._ask(request, list(request.output_token_ids), k, want=k)
        seq.waiting_since = seq.waiting_since if seq.waiting_since is not None else now
        request.awaiting_draft = now - seq.waiting_since < self.config.max_draft_wait_ms / 1000

    def _length(self, request: Request, batch_size: int) -> int:
        """The policy's draft length; 0 where not even drafts that always pass would pay at the measured cost."""
        if self.policy.best_length(1.0, batch_size) > 0:
            return self.policy.draft_length(request.request_id, batch_size)
        self._hopeless_steps += 1
        return 0

    def _probe_due(self) -> bool:
        """While drafting cannot pay, now and then one call that nobody waits for measures the cost again."""
        return self._hopeless_steps > 0 and self._hopeless_steps % _PROBE_HOPELESS_EVERY == 0

    def add_result(self, result: DraftResult, now: float) -> bool:
        """Take an answer in; True when it is the one its sequence is waiting for."""
        seq = self._seqs.get(result.sequence_id)
        if result.error is not None:
            self._failures += 1
            self._paused_until = now + _BACKOFF_S[min(self._failures, len(_BACKOFF_S)) - 1]
        elif result.token_ids:
            self._failures = 0
            per_token = result.s_per_token
            if per_token is None and seq is not None and seq.answered > 0:  # a first call also prefills the prompt
                per_token = result.elapsed_s / len(result.token_ids)
            if per_token is not None:
                self.draft_s_per_token = per_token if self.draft_s_per_token is None else 0.8 * self.draft_s_per_token + 0.2 * per_token
        if seq is not None and result.error is None:
            seq.answered += 1
            seq.exhausted = seq.exhausted or not result.token_ids
        if self.stats.num_drafts >= PRIOR_AFTER_DRAFTS:  # new sequences start from what this drafter achieves
            self.policy.set_prior(self.stats.per_token_acceptance)
        if seq is None or result.call_id != seq.asked_id:
            return False  # a sequence that ended, or an answer overtaken by a newer call
        usable = _inside_vocabulary(result.token_ids, self.vocab_size)
        seq.arrived_base, seq.arrived = seq.asked_base, usable
        # a window cut short where the draft sampled past the target's vocabulary: the cut depends on what was drawn,
        # so verifying the rest against the distributions it was drawn from would bias the output; as one-hot, not
        probs = _matching_probs(result) if len(usable) == len(result.token_ids) else None
        seq.arrived_probs = probs
        seq.asked_id = seq.asked_base = None
        return True

    def expire(self, request: Request, now: float) -> None:
        """A sequence that waited its longest for drafts decodes without them."""
        seq = self._seqs.get(request.request_id)
        if request.awaiting_draft and (seq is None or seq.waiting_since is None
                                       or now - seq.waiting_since >= self.config.max_draft_wait_ms / 1000
                                       or now < self._paused_until):
            request.awaiting_draft = False

    def wait_deadline(self, request: Request) -> float | None:
        seq = self._seqs.get(request.request_id)
        if not request.awaiting_draft or seq is None or seq.waiting_since is None:
            return None
        return seq.waiting_since + self.config.max_draft_wait_ms / 1000

    def take_calls(self) -> list[DraftCall]:
        calls, self._calls = self._calls, []
        return calls

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.policy.record(request.request_id, num_drafted, num_accepted)
        self.stats.observe_draft(num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self._seqs.pop(request_id, None)

    # ---- internals ------------------------------------------------------------------------------
    def _ask(self, request: Request, output: list[int], num_tokens: int, want: int) -> None:
        num_tokens = min(num_tokens, self.max_model_len - request.num_prompt_tokens - len(output))
        if num_tokens <= 0:
            return
        seq = self._seqs[request.request_id]
        seq.asked_id, seq.asked_base, seq.want = next(self._ids), output, want
        self._calls.append(DraftCall(seq.asked_id, self.index, request.request_id, request.prompt_token_ids, output,
                                     num_tokens, request.sampling, request.cache_salt))

    def _usable(self, seq: _Sequence, output: list[int]) -> tuple[list[int], list[SparseProbs] | None]:
        """The arrived proposals that continue ``output`` (see the module docstring) and the distributions they
        were drawn from (None: chosen, not sampled); consumed once read."""
        base, arrived, probs = seq.arrived_base, seq.arrived, seq.arrived_probs
        if base is None or arrived is None or not _extends(output, base):
            return [], None
        seq.arrived_base = seq.arrived = seq.arrived_probs = None
        emitted = len(output) - len(base)
        if output[len(base):] != arrived[:emitted]:
            return [], None
        return arrived[emitted:], probs[emitted:] if probs is not None else None


def _inside_vocabulary(token_ids: list[int], vocab_size: int | None) -> list[int]:
    """The proposals up to the first id the target has no embedding for (a draft model's padded vocabulary may be
    larger): verification would reject it anyway, and everything after it depends on it."""
    if vocab_size is None:
        return list(token_ids)
    cut = next((i for i, token in enumerate(token_ids) if type(token) is not int or not 0 <= token < vocab_size),
               len(token_ids))
    return list(token_ids[:cut])


def _matching_probs(result: DraftResult) -> list[SparseProbs] | None:
    """The result's distributions if each is one (finite values >= 0 summing to 1) in which its proposal has a
    chance; else None: the proposals are then verified as one-hot, which is lossless for any tokens, where a
    distribution that did not produce them (a corrupted or foreign answer) would not be."""
    probs = result.probs
    if probs is None or len(probs) != len(result.token_ids):
        return None
    for token, (ids, values) in zip(result.token_ids, probs):
        chances = dict(zip(ids, values))
        if len(ids) != len(values) or not chances.get(token, 0) > 0 or not _a_distribution(values):
            return None
    return [(list(ids), list(values)) for ids, values in probs]


def _a_distribution(values) -> bool:
    return all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in values) and abs(sum(values) - 1) < 1e-3


def _extends(output: list[int], base: list[int] | None) -> bool:
    """Whether ``output`` starts with ``base``."""
    return base is not None and len(output) >= len(base) and output[: len(base)] == base
