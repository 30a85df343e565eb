"""The speculation controller: which running sequences draft, how many tokens, and what became of them.

An engine has one drafter per entry of ``engine.speculative`` (``EngineConfig.drafters``); a request names
the one that drafts for it (``request.drafter``, from the name it was sent to), or none. After each step
the engine calls :meth:`SpeculationController.propose` for the sequences that will decode next; each gets
``request.spec_token_ids`` (possibly none), which the scheduler adds to its next step and the runner
verifies. :meth:`record` takes each verification's outcome into the drafter's draft-length policy
(``policy.py``: drafts shrink, and stop, where they do not pay) and counters (``stats.py``).

- ``ngram``: prompt lookup, computed here at once.
- ``model``: a draft model on other replicas, asked without waiting (``remote.py``): its calls go out
  through :meth:`take_calls`, its answers come back through :meth:`add_results`, and a sequence whose
  drafts are still being computed may wait for them (``request.awaiting_draft``) for a bounded time.

Verification is lossless (``verify.py``): a greedy request's output is exactly what it is without
speculation. A draft never crosses the request's ``max_tokens`` or the context length.
"""

from __future__ import annotations

from typing import Sequence

from app.config import SpecConfig
from app.engine.request import Request
from app.spec.ngram import NgramProposer
from app.spec.policy import PRIOR_AFTER_DRAFTS, DraftLengthPolicy, DraftPolicyConfig, StepCosts
from app.spec.remote import DraftCall, DraftResult, ModelDrafter
from app.spec.stats import SpecDecodingStats

_NGRAM_FIRST_PRIOR = 0.7  # a prompt-lookup match is usually right for a few tokens (until this drafter's rate is known)


class NgramDrafter:
    def __init__(self, config: SpecConfig, max_model_len: int, step_costs: StepCosts | None = None) -> None:
        self.config = config
        self.proposer = NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max, max_model_len)
        # n-gram drafts cost next to nothing next to a target step; verifying them does not, once the batch is large.
        # A new sequence starts from what this drafter's drafts achieve (on chat, a few in two pass; on rewrites, most),
        # so that in a large batch it does not verify a full window before its own history says whether that pays.
        policy = DraftPolicyConfig(num_speculative_tokens=config.num_speculative_tokens, saturation_tokens=config.saturation_tokens,
                                   start_from_prior=True, prior_acceptance=_NGRAM_FIRST_PRIOR, adaptive=config.adaptive)
        self.policy = DraftLengthPolicy(policy, step_costs)
        self.stats = SpecDecodingStats.new(config.num_speculative_tokens)

    def propose(self, request: Request, limit: int, batch_size: int, target_step_s: float, now: float) -> None:
        k = min(limit, self.policy.draft_length(request.request_id, batch_size)) if limit > 0 else 0
        drafts = self.proposer.propose(request.all_token_ids, k) if k > 0 else []
        if k > 0 and not drafts:
            self.policy.nothing_drafted(request.request_id)
        request.set_drafts(drafts)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.policy.record(request.request_id, num_drafted, num_accepted)
        self.stats.observe_draft(num_drafted, num_accepted)
        if self.stats.num_drafts >= PRIOR_AFTER_DRAFTS:
            self.policy.set_prior(self.stats.per_token_acceptance)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)


class SpeculationController:
    def __init__(self, configs: Sequence[SpecConfig], max_model_len: int, vocab_size: int | None = None) -> None:
        """``vocab_size``: the target's; a draft model's proposal past it (a larger padded vocabulary) is cut there."""
        self.configs = list(configs)
        self.max_model_len = max_model_len
        self.step_costs = StepCosts()  # what verifying more tokens costs this target, as its steps measure it
        self.drafters = [
            ModelDrafter(i, c, max_model_len, self.step_costs, vocab_size) if c.drafter == "model"
            else NgramDrafter(c, max_model_len, self.step_costs)
            for i, c in enumerate(self.configs)
        ]

    @property
    def stats(self) -> SpecDecodingStats:
        """All drafters' counters together (the model's own totals)."""
        total = SpecDecodingStats.new(max(c.num_speculative_tokens for c in self.configs))
        for drafter in self.drafters:
            total += drafter.stats
        return total

    def stats_by_name(self) -> dict[str | None, dict]:
        """Each drafter's counters under the name it is served as."""
        return {c.served_name: d.stats.to_dict() for c, d in zip(self.configs, self.drafters)}

    def propose(self, decoding: Sequence[Request], target_step_s: float, now: float) -> list[tuple[Request, Exception]]:
        """Give each sequence about to decode its drafts for the next step (an empty list where it should not).
        Returns the sequences whose drafting raised, with the exception: theirs alone, the others still draft."""
        failed = []
        for request in decoding:
            drafter = self._drafter(request)
            if drafter is None:
                request.set_drafts([])
                continue
            try:
                drafter.propose(request, self._limit(request), len(decoding), target_step_s, now)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which fails this request
                request.set_drafts([])
                failed.append((request, exc))
        return failed

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        drafter = self._drafter(request)
        if drafter is not None:
            drafter.record(request, num_drafted, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that only decoded (last tokens and their drafts): its time, for the draft-length policies."""
        self.step_costs.observe(num_tokens, seconds)

    def forget(self, request_id: str) -> None:
        for drafter in self.drafters:
            drafter.forget(request_id)

    # ---- drafts computed elsewhere (drafter: model) -------------------------------------------
    def take_calls(self) -> list[DraftCall]:
        return [call for d in self.drafters if isinstance(d, ModelDrafter) for call in d.take_calls()]

    def add_results(self, results: Sequence[DraftResult], running: Sequence[Request], target_step_s: float, now: float) -> None:
        """Take answers in; a sequence waiting for one gets its drafts at once."""
        by_id = {r.request_id: r for r in running}
        for result in results:
            drafter = self.drafters[result.drafter] if 0 <= result.drafter < len(self.drafters) else None
            if not isinstance(drafter, ModelDrafter) or not drafter.add_result(result, now):
                continue
            request = by_id.get(result.sequence_id)
            if request is not None and request.awaiting_draft:
                drafter.propose(request, self._limit(request), len(running), target_step_s, now)

    def expire(self, running: Sequence[Request], now: float) -> None:
        """Sequences that waited their longest for drafts decode without them."""
        for request in running:
            drafter = self._drafter(request)
            if request.awaiting_draft and isinstance(drafter, ModelDrafter):
                drafter.expire(request, now)
            elif request.awaiting_draft:
                request.awaiting_draft = False

    def next_deadline(self, running: Sequence[Request]) -> float | None:
        """When the earliest waiting sequence stops waiting (None: none waits)."""
        deadlines = [d.wait_deadline(r) for r in running if isinstance(d := self._drafter(r), ModelDrafter)]
        deadlines = [t for t in deadlines if t is not None]
        return min(deadlines) if deadlines else None

    # ---- internals ----------------------------------------------------------------------------
    def _drafter(self, request: Request):
        index = request.drafter
        return self.drafters[index] if index is not None and 0 <= index < len(self.drafters) else None

    def _limit(self, request: Request) -> int:
        """The most drafts this request may take now (0: none)."""
        config = self.configs[request.drafter]
        limit = min(config.num_speculative_tokens, request.sampling.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
        return max(limit, 0)
