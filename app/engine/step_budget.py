"""What a step may carry: its cost as the steps measure it (``StepCost``, which sizes prefill chunks beside decodes)
and the cap on its tokens after one ran out of memory (``StepTokenCap``)."""

from __future__ import annotations

import numpy as np

from app.engine.scheduler import SchedulerOutput


class StepCost:
    """What sizes prefill chunks beside decodes (stall-free scheduling): a step's seconds (all of it, scheduling and
    emitting included: the gap its streams see) as ``a + b * tokens + c * keys``, ``keys`` being the attended keys
    summed over the step's tokens. ``a`` is what every step pays (the layers' Python, the weights streamed once); a
    chunk deep in a long prompt attends to everything before it, so its tokens cost more than the first chunk's (on
    two AVX2 cores, about twice as much 1,500 tokens in), which a cost per token alone would learn only after the
    steps had overrun. Fitted by least squares over every step (the warm-up's full-budget step first), each older
    step weighing ``DECAY`` times less; terms the steps seen cannot tell apart yet are left out (``c`` while every
    step has alike keys per token, then ``a``)."""

    DECAY = 0.95  # weight of a step one step older
    # A bound is planned to this share of it: steps scatter around the fit (a few % on a shared 2-core machine) and
    # their tokens still have to reach the streams. Planned to the whole 200 ms, W1's streams saw gaps of 201-215 ms.
    PLANNED_SHARE = 0.9
    _SCALE = np.array([1.0, 1e-2, 1e-5])  # features to similar magnitudes: 1, ~100 tokens, ~100k keys

    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._fitted: tuple[float, float, float] | None = None  # solved once per observed step, read many times

    def observe(self, tokens: int, seconds: float, keys: float = 0.0) -> None:
        x = np.array([1.0, tokens, keys]) * self._SCALE
        self._xtx = self.DECAY * self._xtx + np.outer(x, x)
        self._xty = self.DECAY * self._xty + x * seconds
        self._fitted = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(seconds a step, seconds per token, seconds per attended key), or None before any step."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float, float] | None:
        if not self._xtx[1, 1]:
            return None
        for terms in ([0, 1, 2], [0, 1], [1]):  # the fullest model the observations determine, with no negative cost
            xtx, xty = self._xtx[np.ix_(terms, terms)], self._xty[terms]
            if np.linalg.cond(xtx) > 1e8:
                continue
            fitted = np.linalg.solve(xtx, xty)
            if (fitted >= 0).all() and fitted[terms.index(1)] > 0:
                full = np.zeros(3)
                full[terms] = fitted
                return tuple(float(v) for v in full * self._SCALE)
        return 0.0, float(self._xty[1] / self._xtx[1, 1] * self._SCALE[1]), 0.0

    def seconds(self, tokens: int, keys: float = 0.0) -> float:
        """A step's predicted seconds for ``tokens`` tokens attending to ``keys`` keys in all (0 before any step)."""
        a, b, c = self.coefficients() or (0.0, 0.0, 0.0)
        return a + b * tokens + c * keys

    def tokens_within_bound(self, bound_s: float, prefill_offset: int) -> int | None:
        """The most tokens a step carrying decodes may hold so that the streams' gap stays within ``bound_s``, planned
        to ``PLANNED_SHARE`` of it, while the deepest prompt still prefilling is ``prefill_offset`` tokens in (its
        next chunk attends to everything before it, and to itself)."""
        seconds = bound_s * self.PLANNED_SHARE
        tokens = self.tokens_within(seconds, prefill_offset)
        return tokens if tokens is None else self.tokens_within(seconds, prefill_offset + tokens / 2)

    def tokens_within(self, seconds: float, keys_per_token: float = 0.0) -> int | None:
        """How many tokens a step may carry to last about ``seconds`` when each attends to ``keys_per_token`` keys
        (None: nothing measured yet)."""
        fitted = self.coefficients()
        if fitted is None:
            return None
        a, b, c = fitted
        return max(int((seconds - a) / (b + c * keys_per_token)), 0)


def attended_keys(scheduled: SchedulerOutput) -> float:
    """The keys a step's tokens attend to, summed: a chunk of ``n`` tokens from position ``p`` attends to
    ``p + 1 .. p + n`` keys."""
    return sum(item.num_new_tokens * (item.request.num_computed_tokens + (item.num_new_tokens + 1) / 2)
               for item in scheduled.scheduled)


class StepTokenCap:
    """The most tokens a step carries after one ran out of memory (a GPU's activations beside its KV pool, a long
    prompt's chunk): halved from the size that failed, so that later steps do not each pay a failing pass before
    their parts run; doubled back every ``REGROW_STEPS`` steps without one (the shortage may have passed), up to
    ``engine.max_num_batched_tokens``, where it is lifted."""

    REGROW_STEPS = 1000

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cap: int | None = None
        self._fitting = 0  # steps since the last shrink

    @property
    def tokens(self) -> int:
        return self.limit if self.cap is None else self.cap

    def shrink(self, failed_tokens: int) -> None:
        self.cap = max(1, min(self.tokens, failed_tokens // 2))
        self._fitting = 0

    def fitted(self) -> None:
        if self.cap is None:
            return
        self._fitting += 1
        if self._fitting >= self.REGROW_STEPS:
            self.cap, self._fitting = (None if self.cap * 2 >= self.limit else self.cap * 2), 0
