"""Speculative-decoding counters, named as vLLM names them (``vllm/v1/spec_decode/metrics.py``).

- ``num_drafts``: verified drafts (a sequence-step that drafted at least one token).
- ``num_draft_tokens``: drafted tokens, ``num_accepted_tokens``: accepted ones.
- ``num_accepted_tokens_per_pos[i]``: drafts whose token at position i was accepted (and so every token
  before it); its length is the longest draft seen (or ``num_spec_tokens`` given up front).
- ``acceptance_rate = num_accepted_tokens / num_draft_tokens`` (0.0 before any draft).
- ``mean_acceptance_length = 1 + num_accepted_tokens / num_drafts``: tokens emitted per verified draft,
  the bonus or recovered token included (1.0 before any draft: one token per step).

Counters add (``a + b``, ``a += b``: one engine's steps, or many replicas' totals) and round-trip through
``to_dict`` / ``from_dict`` (plain ints, floats and lists: JSON and Ray-serializable). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_trials: int = 0  # draft tokens the target tested: the accepted ones and each draft's first rejection

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        """Empty counters with the per-position list sized for drafts of up to ``num_spec_tokens``."""
        return cls(num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One sequence-step: it drafted ``num_draft_tokens`` and the first ``num_accepted_tokens`` passed."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError("need 0 <= num_accepted_tokens <= num_draft_tokens")
        if num_draft_tokens == 0:
            return  # nothing was drafted: not a draft
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.num_trials += num_accepted_tokens + (num_accepted_tokens < num_draft_tokens)
        self._grow(num_draft_tokens)
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def observe_batch(self, num_draft_tokens: Iterable[int], num_accepted_tokens: Iterable[int]) -> None:
        """A whole step: per-sequence drafted and accepted counts (lists, or tensors via ``.tolist()``)."""
        drafted = num_draft_tokens.tolist() if hasattr(num_draft_tokens, "tolist") else list(num_draft_tokens)
        accepted = num_accepted_tokens.tolist() if hasattr(num_accepted_tokens, "tolist") else list(num_accepted_tokens)
        if len(drafted) != len(accepted):
            raise ValueError("one drafted and one accepted count per sequence")
        for d, a in zip(drafted, accepted):
            self.observe_draft(int(d), int(a))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """The chance a tested draft token passes (what the draft-length policy's ``a`` is): accepted over tested,
        not over drafted, since the tokens after a rejection are never tested."""
        return self.num_accepted_tokens / self.num_trials if self.num_trials else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Fraction of drafts whose token at each position was accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.num_accepted_tokens_per_pos]

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        if not isinstance(other, SpecDecodingStats):
            return NotImplemented
        out = SpecDecodingStats.from_dict(self.to_dict())
        out += other
        return out

    def __iadd__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        if not isinstance(other, SpecDecodingStats):
            return NotImplemented
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_trials += other.num_trials
        self._grow(len(other.num_accepted_tokens_per_pos))
        for pos, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[pos] += n
        return self

    def to_dict(self) -> dict[str, Any]:
        """The counters and the derived figures (``from_dict`` reads back the counters)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "num_trials": self.num_trials,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecDecodingStats:
        return cls(
            num_drafts=int(data.get("num_drafts", 0)),
            num_draft_tokens=int(data.get("num_draft_tokens", 0)),
            num_accepted_tokens=int(data.get("num_accepted_tokens", 0)),
            num_accepted_tokens_per_pos=[int(n) for n in data.get("num_accepted_tokens_per_pos", [])],
            num_trials=int(data.get("num_trials", 0)),
        )

    def _grow(self, length: int) -> None:
        if len(self.num_accepted_tokens_per_pos) < length:
            self.num_accepted_tokens_per_pos.extend([0] * (length - len(self.num_accepted_tokens_per_pos)))
