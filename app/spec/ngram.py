"""N-gram (prompt lookup) drafting, as vLLM's ngram proposer: no model, no probabilities.

For a sequence ``t = prompt + output`` of length L, for ``n = max_n, max_n - 1, ..., min_n``: find the
most recent *earlier* occurrence of the last n tokens, i.e. the largest ``i < L - n`` with
``t[i:i+n] == t[L-n:]``, and propose the tokens that followed it, ``t[i+n : i+n+k]`` (fewer than k when
the occurrence ends near the end of t; at least one, since ``i + n <= L - 1``). The first n with a match
wins, so a longer match is always preferred to a more recent shorter one. No match for any n: no draft.

The draft carries no probabilities, so it is verified with ``rejection_sample(..., draft_probs=None)``
(q one-hot at the drafted token), which is lossless for any drafted tokens. ``propose_batch`` returns the
padded ``[B, K]`` / ``[B]`` layout that ``rejection_sample`` takes.

Each call is one vectorized comparison per n over the sequence (numpy sliding windows): O(L * n) work
with no per-sequence state, so preemption, prefix-cache hits or aborted drafts need no bookkeeping.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from app.spec.rejection import PLACEHOLDER_TOKEN_ID


class NgramProposer:
    """Prompt-lookup drafts of up to ``num_speculative_tokens`` tokens from n-grams of min_n..max_n."""

    def __init__(
        self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3, max_model_len: int | None = None
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len  # a draft never takes the sequence beyond it

    def propose(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``num_speculative_tokens``) drafted tokens for one sequence; ``[]`` if none.

        token_ids: the whole sequence so far (prompt + output), 1-D.
        """
        tokens = _as_array(token_ids)  # [L]
        L = tokens.shape[0]
        k = self.k if k is None else k
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - L)
        if k <= 0 or L < self.min_n + 1:
            return []
        head = tokens[: L - 1]  # [L-1]: an occurrence must end before the last token, so one token follows
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(head, n)  # [L-n, n], row i = t[i:i+n]
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))  # starts i < L - n, ascending
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's follower
                return tokens[start: start + k].tolist()
        return []

    def propose_batch(
        self,
        token_ids: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        k: int | Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for B sequences, padded for ``rejection_sample``.

        k: one length for all, or one per sequence (e.g. from ``DraftLengthPolicy``); default
           ``num_speculative_tokens``.
        Returns (draft_token_ids [B, K] long, padded with ``PLACEHOLDER_TOKEN_ID``; num_draft_tokens [B] long),
        with ``K = max(k)`` so the width does not depend on what was found.
        """
        B = len(token_ids)
        ks = [self.k if k is None else k] * B if k is None or isinstance(k, int) else [int(x) for x in k]
        if len(ks) != B:
            raise ValueError(f"{len(ks)} draft lengths for {B} sequences")
        drafts = [self.propose(t, kb) if kb > 0 else [] for t, kb in zip(token_ids, ks)]
        width = max(ks, default=0)
        out = torch.full((B, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long)  # [B, K]
        for b, draft in enumerate(drafts):
            if draft:
                out[b, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        counts = torch.tensor([len(d) for d in drafts], dtype=torch.long)  # [B]
        return out.to(device) if device is not None else out, counts.to(device) if device is not None else counts


def _as_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)
