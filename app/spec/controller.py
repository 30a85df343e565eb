"""The speculation controller: which running sequences draft, how many tokens, and what became of them.

The engine calls :meth:`SpeculationController.propose` after each step for the sequences that will decode
next; each gets ``request.spec_token_ids`` (possibly none), which the scheduler adds to its next step and
the runner verifies. :meth:`record` takes each verification's outcome into the draft-length policy
(``policy.py``: drafts shrink, and stop, where they do not pay) and the counters (``stats.py``).

Any request may draft (``request.speculate``): verification is lossless (``verify.py``), and a greedy
request's output is exactly what it is without speculation. A draft never crosses the request's
``max_tokens`` or the context length.
"""

from __future__ import annotations

from typing import Sequence

from app.config import SpecConfig
from app.engine.request import Request
from app.spec.ngram import NgramProposer
from app.spec.policy import DraftLengthPolicy, DraftPolicyConfig
from app.spec.stats import SpecDecodingStats


class SpeculationController:
    def __init__(self, config: SpecConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max, max_model_len)
        # n-gram drafts cost next to nothing next to a target step; verifying them does not, once the batch is large
        policy = DraftPolicyConfig(num_speculative_tokens=config.num_speculative_tokens, saturation_tokens=config.saturation_tokens)
        self.policy = DraftLengthPolicy(policy)
        self.stats = SpecDecodingStats.new(config.num_speculative_tokens)

    def propose(self, decoding: Sequence[Request]) -> None:
        """Give each sequence about to decode its drafts for the next step (an empty list where it should not)."""
        for request in decoding:
            limit = self._limit(request)
            k = min(limit, self.policy.draft_length(request.request_id, len(decoding))) if limit > 0 else 0
            request.spec_token_ids = self.proposer.propose(request.all_token_ids, k) if k > 0 else []

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.policy.record(request.request_id, num_drafted, num_accepted)
        self.stats.observe_draft(num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)

    def _limit(self, request: Request) -> int:
        """The most drafts this request may take now (0: none)."""
        if not request.speculate:
            return 0
        limit = min(self.config.num_speculative_tokens, request.sampling.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
        return max(limit, 0)
