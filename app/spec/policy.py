"""How many tokens to draft for each sequence, from its acceptance history, the batch size and the cost.

Model (Leviathan et al. 2023): each drafted token is accepted with probability ``a``, independently,
until the first rejection; a step with k drafted tokens then emits

    E(a, k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)      (k + 1 when a = 1)

tokens (accepted drafts plus the recovered or bonus token). Its cost, in units of one plain decode step
of the target at the same batch, is

    C(k, B) = v(k, B) + k * c,    v(k, B) = (1 + B (k + 1) / S) / (1 + B / S)

- ``c`` (``cost_ratio``): the measured cost of drafting one token for the batch divided by the target's
  one-token decode step for the batch (about 0 for n-gram lookup; ~0.05-0.2 for a small draft model).
- ``v``: what verifying k + 1 tokens per sequence costs against decoding one. A target step is modelled
  as a fixed part (streaming the weights) plus a part per batched token, ``t(T) ~ 1 + T / S``, where
  ``S`` (``saturation_tokens``) is the token count at which the two parts are equal: ``S = inf`` is a
  purely memory-bound target (verification is free, v = 1); a large batch ``B`` makes v approach k + 1,
  which is why speculation stops paying under load. Where the engine has timed its own decode steps of
  ``B`` and ``B (k + 1)`` tokens (:class:`StepCosts`), ``v`` is their measured ratio instead: real kernels
  are not smooth in the token count (GPTQ's CPU int4 kernel takes rows four at a time, so a step of 5
  tokens costs ~1.4x one of 4 while 4 cost ~1.2x one of 1), and the draft length that pays follows them.

The expected speed-up is ``E(a, k) / C(k, B)`` (1 at k = 0). The policy drafts the k in
``{0} | [min_draft_tokens, num_speculative_tokens]`` with the largest speed-up, and 0 when the best is
below ``min_speedup`` (default 1: speculation does not pay).

Acceptance estimate: a draft of k tokens with m accepted is m Bernoulli successes plus one failure if
m < k (the tokens after a rejection are never tested). The policy keeps exponentially decayed sums of
successes and trials, ``a = successes / trials`` (the maximum-likelihood estimate under the model), with
a small prior. The decay is per step of the sequence (every ``draft_length`` call), not per draft, so
history gathered long ago, while speculation was off, counts little against a fresh probe.

Re-probing: a sequence at 0 drafts ``probe_draft_tokens`` once after ``probe_interval`` steps at 0, to
refresh its estimate; each probe that does not bring speculation back doubles the interval (up to
``max_probe_interval``); speculation coming back resets it. A sequence with no history yet drafts
``num_speculative_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence


PRIOR_AFTER_DRAFTS = 8  # verified drafts before a drafter's own acceptance rate is every new sequence's prior


def expected_tokens_per_step(a: float, k: int) -> float:
    """E(a, k) = (1 - a^(k+1)) / (1 - a): tokens emitted by a step drafting k, for acceptance rate a."""
    if k < 0 or not 0.0 <= a <= 1.0:
        raise ValueError("need k >= 0 and 0 <= a <= 1")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class StepCosts:
    """The target's measured decode-step time by the tokens the step carried (an EMA per token count).

    The engine reports every step that only decoded (each sequence its last token, plus its drafts); a count
    is trusted once it has ``min_samples`` steps. One instance per engine, shared by its drafters.
    """

    def __init__(self, decay: float = 0.8, min_samples: int = 3) -> None:
        if not 0 < decay < 1 or min_samples < 1:
            raise ValueError("need 0 < decay < 1 and min_samples >= 1")
        self.decay, self.min_samples = decay, min_samples
        self._seconds: dict[int, float] = {}
        self._samples: dict[int, int] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds < 0:
            raise ValueError("need tokens >= 1 and seconds >= 0")
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self._samples[tokens] = self._samples.get(tokens, 0) + 1

    def seconds(self, tokens: int) -> float | None:
        """The step time for this many tokens, or None before ``min_samples`` such steps."""
        return self._seconds[tokens] if self._samples.get(tokens, 0) >= self.min_samples else None

    def ratio(self, tokens: int, base_tokens: int) -> float | None:
        """t(tokens) / t(base_tokens) when both are measured, never below 1 for more tokens (noise aside)."""
        t, base = self.seconds(tokens), self.seconds(base_tokens)
        if t is None or not base:
            return None
        return max(t / base, 1.0) if tokens >= base_tokens else t / base


def verify_cost(k: int, batch_size: int, saturation_tokens: float = math.inf, step_costs: StepCosts | None = None) -> float:
    """v(k, B): a target step over B sequences of k + 1 tokens, in units of one with 1 token each."""
    B = max(batch_size, 1)
    measured = step_costs.ratio(B * (k + 1), B) if step_costs is not None and k > 0 else None
    if measured is not None:
        return measured
    if math.isinf(saturation_tokens):
        return 1.0
    return (1.0 + B * (k + 1) / saturation_tokens) / (1.0 + B / saturation_tokens)


def expected_speedup(
    a: float, k: int, cost_ratio: float, batch_size: int = 1, saturation_tokens: float = math.inf,
    step_costs: StepCosts | None = None,
) -> float:
    """E(a, k) / (v(k, B) + k c): tokens per unit of time against plain decoding (1.0 at k = 0)."""
    v = verify_cost(k, batch_size, saturation_tokens, step_costs)
    return expected_tokens_per_step(a, k) / (v + k * cost_ratio)


@dataclass
class DraftPolicyConfig:
    num_speculative_tokens: int  # the longest draft, and the length with no history yet
    min_draft_tokens: int = 1  # the shortest draft when speculating
    cost_ratio: float = 0.0  # c: draft cost per token / target one-token step (updated as measured)
    saturation_tokens: float = math.inf  # S: batched tokens at which a target step costs twice a tiny one
    min_speedup: float = 1.0  # below this expected speed-up, draft nothing
    ema_decay: float = 0.8  # history weight kept per step of the sequence
    prior_acceptance: float = 0.5
    prior_weight: float = 1.0  # in Bernoulli trials
    probe_interval: int = 16  # steps at 0 before a probe
    max_probe_interval: int = 256
    probe_draft_tokens: int | None = None  # default: num_speculative_tokens
    # A sequence with no history drafts num_speculative_tokens (False), or what its prior says pays (True).
    start_from_prior: bool = False
    adaptive: bool = True  # False: every length is num_speculative_tokens, whatever it costs (vLLM's behaviour)

    def __post_init__(self) -> None:
        if not 1 <= self.min_draft_tokens <= max(self.num_speculative_tokens, 1):
            raise ValueError("need 1 <= min_draft_tokens <= num_speculative_tokens")
        if self.cost_ratio < 0 or self.saturation_tokens <= 0 or not 0 < self.ema_decay <= 1:
            raise ValueError("need cost_ratio >= 0, saturation_tokens > 0, 0 < ema_decay <= 1")
        if not 0 <= self.prior_acceptance <= 1 or self.prior_weight <= 0:
            raise ValueError("need 0 <= prior_acceptance <= 1 and prior_weight > 0")
        if not 1 <= self.probe_interval <= self.max_probe_interval:
            raise ValueError("need 1 <= probe_interval <= max_probe_interval")


@dataclass
class _Sequence:
    successes: float
    trials: float
    steps_since_record: int = 0
    observed: bool = False
    steps_off: int = 0  # consecutive steps at 0
    probe_interval: int = 16
    probing: bool = False  # the last length handed out was a probe's


class DraftLengthPolicy:
    """Per-sequence draft lengths; one instance per engine, sequences keyed by request id."""

    def __init__(self, config: DraftPolicyConfig, step_costs: StepCosts | None = None) -> None:
        self.config = config
        self.cost_ratio = config.cost_ratio
        self.step_costs = step_costs  # the target's measured step times, where the engine reports them
        self._seqs: dict[Hashable, _Sequence] = {}

    def update_cost_ratio(self, measured: float, weight: float = 0.2) -> None:
        """Blend a fresh measurement of c (draft s per token / target s per one-token step) into the estimate."""
        if measured < 0 or not 0 < weight <= 1:
            raise ValueError("need measured >= 0 and 0 < weight <= 1")
        self.cost_ratio = (1 - weight) * self.cost_ratio + weight * measured

    def set_prior(self, acceptance: float) -> None:
        """The acceptance rate sequences seen from now on start from (e.g. the drafter's rate so far)."""
        self.config.prior_acceptance = min(max(acceptance, 0.0), 1.0)

    def acceptance(self, seq_id: Hashable) -> float:
        """The sequence's current acceptance-rate estimate (the prior before any draft)."""
        s = self._state(seq_id)
        return s.successes / s.trials

    def best_length(self, a: float, batch_size: int) -> int:
        """argmax over k in {0} | [min, max] of the expected speed-up; 0 below ``min_speedup``."""
        cfg = self.config
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        best_k, best = 0, 1.0
        for k in range(cfg.min_draft_tokens, cfg.num_speculative_tokens + 1):
            speedup = expected_speedup(a, k, self.cost_ratio, batch_size, cfg.saturation_tokens, self.step_costs)
            if speedup > best:
                best_k, best = k, speedup
        return best_k if best >= cfg.min_speedup else 0

    def draft_length(self, seq_id: Hashable, batch_size: int) -> int:
        """How many tokens to draft for this sequence at this step (one call per sequence per step)."""
        cfg, s = self.config, self._state(seq_id)
        s.steps_since_record += 1
        if not s.observed and not cfg.start_from_prior:
            return cfg.num_speculative_tokens
        k = self.best_length(s.successes / s.trials, batch_size)
        s.probing = False
        if k > 0:
            s.steps_off, s.probe_interval = 0, cfg.probe_interval
            return k
        s.steps_off += 1
        if s.steps_off < s.probe_interval:
            return 0
        s.steps_off, s.probing = 0, True
        s.probe_interval = min(2 * s.probe_interval, cfg.max_probe_interval)  # reset if speculation returns
        return cfg.num_speculative_tokens if cfg.probe_draft_tokens is None else cfg.probe_draft_tokens

    def nothing_drafted(self, seq_id: Hashable) -> None:
        """The length just handed out found nothing to draft (no n-gram match): a probe stays due, for the next
        step to look again, instead of counting as one that failed (doubling the wait for the next)."""
        s = self._seqs.get(seq_id)
        if s is not None and s.probing:
            s.probing = False
            s.probe_interval = max(s.probe_interval // 2, self.config.probe_interval)
            s.steps_off = s.probe_interval - 1

    def draft_lengths(self, seq_ids: Sequence[Hashable], batch_size: int | None = None) -> list[int]:
        """``draft_length`` for every sequence of a step; the batch size defaults to ``len(seq_ids)``."""
        B = len(seq_ids) if batch_size is None else batch_size
        return [self.draft_length(seq_id, B) for seq_id in seq_ids]

    def record(self, seq_id: Hashable, num_drafted: int, num_accepted: int) -> None:
        """What verification made of this step's draft (nothing to record when none was drafted)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError("need 0 <= num_accepted <= num_drafted")
        if num_drafted == 0:
            return
        s = self._state(seq_id)
        decay = self.config.ema_decay ** max(s.steps_since_record, 1)
        s.successes = decay * s.successes + num_accepted
        s.trials = decay * s.trials + num_accepted + (1 if num_accepted < num_drafted else 0)
        s.steps_since_record, s.observed = 0, True

    def forget(self, seq_id: Hashable) -> None:
        self._seqs.pop(seq_id, None)

    def _state(self, seq_id: Hashable) -> _Sequence:
        s = self._seqs.get(seq_id)
        if s is None:
            cfg = self.config
            s = _Sequence(cfg.prior_acceptance * cfg.prior_weight, cfg.prior_weight,
                          probe_interval=cfg.probe_interval)
            self._seqs[seq_id] = s
        return s
