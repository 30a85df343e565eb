"""Lossless rejection sampling of drafted tokens (Leviathan et al. 2023; Chen et al. 2023), batched.

Layout: **padded**. B sequences share one ``[B, K]`` draft tensor; sequence ``b`` drafted
``n_b = num_draft_tokens[b] <= K`` tokens and the rest of its row is padding (any value, ignored).
``target_probs[b, j]`` (``j = 0..K``) is the target's distribution for the token that follows the
context plus ``draft[b, :j]``; the sequence's bonus position is ``j = n_b`` (not K), and rows past it
are ignored. A sequence with ``n_b = 0`` simply samples one token from ``target_probs[b, 0]``, so
speculating and non-speculating sequences share a batch. Runners that compute target logits packed
(``n_b + 1`` rows per sequence, one after another) turn them into this layout with
``padded_from_packed``. Padded was chosen over packed because every step below is then a whole-batch
tensor op on ``[B, K]`` / ``[B, V]`` with no segment arithmetic, and K is small (<= ~8).

The rule, per sequence and position ``j < n_b`` with drafted token ``x``:
- sampled rows: accept ``x`` with probability ``min(1, p_j(x) / q_j(x))``; at the first rejection emit a
  token from ``norm(max(0, p_j - q_j))`` (the *recovered* token) and stop; if all ``n_b`` are accepted,
  emit a *bonus* token from ``p_{n_b}``. Every emitted token is then distributed exactly as the target
  would have sampled it, whatever q is, provided ``x`` was drawn from ``q_j``.
- greedy rows: accept while ``x == argmax p_j``; emit ``argmax p_j`` at the first mismatch, or the bonus
  ``argmax p_{n_b}``. No random numbers are drawn.

``draft_probs=None`` means q is one-hot at the drafted token (a drafter with no probabilities, such as
n-gram lookup, or a draft model that picked its tokens deterministically): acceptance is then
``p_j(x)`` and the residual is ``p_j`` with ``x`` removed, which is lossless for *any* choice of drafted
tokens. Passing a soft q for tokens that were not sampled from it is not lossless.

Vocabulary sizes may differ by padding (``V_q != V_p``). Acceptance compares p and q on the shared
vocabulary ``[0, min(V_q, V_p))``: a drafted id ``>= V_p`` has ``p = 0`` and is always rejected; draft
mass on ids ``>= V_p`` is dropped (the target can never emit them); target ids ``>= V_q`` have
``q = 0``, so their mass stays in the residual and bonus, and outputs range over the target's vocabulary
(truncating p to the shared vocabulary instead would lose that mass: the same thing exactly when the
target gives padding ids probability 0, as masked logits do).

p and q must be the request's *processed* distributions (penalties, min_tokens, temperature, top-k/p,
min-p applied identically to both): ``app.spec.probs.processed_probs`` produces them.

Seeded rows (a sampled row with a ``torch.Generator``) follow a coupled rule instead: at each position
``j <= n_b`` the target's token is drawn from ``p_j`` with one uniform of the row's generator, exactly as the
engine's sampler draws a token (``draw_rows``), and the draft is kept while it equals that token; the first
token that differs, or the bonus, is emitted and nothing more is drawn. Every emitted token is then the
target's own draw (lossless for any drafter), and a seeded sequence's k-th token always comes from its k-th
uniform, so its tokens do not depend on how many tokens were drafted (which the draft-length policy sizes by
the batch): the same alone, in any batch, and as without speculation. For a one-hot q it accepts with
probability ``p_j(x)``, as the rule above does; for a sampled q it accepts less (``sum q p`` for
``sum min(p, q)``): the price a seeded request pays for its reproducibility. Rows without a generator draw
from torch's default generator; greedy rows draw nothing. Sampled tokens are drawn by the engine sampler's
own ``draw_rows`` (the cumulative weights inverted at one uniform), which samples from ``r / sum(r)`` without
normalizing r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from app.engine.sampling import draw_rows

PLACEHOLDER_TOKEN_ID = -1  # fills token_ids past each sequence's emitted tokens (vLLM's placeholder)


@dataclass
class RejectionOutput:
    """``token_ids[b, :num_accepted[b] + 1]`` are sequence b's new tokens: its accepted draft prefix, then
    the recovered (first rejection) or bonus (all accepted) token; the rest is ``PLACEHOLDER_TOKEN_ID``."""

    token_ids: torch.Tensor  # [B, K+1] long
    num_accepted: torch.Tensor  # [B] long, in [0, n_b]

    @property
    def num_emitted(self) -> torch.Tensor:  # [B] long, num_accepted + 1
        return self.num_accepted + 1

    def tolist(self) -> list[list[int]]:
        """Each sequence's new tokens as a list (accepted drafts + one more)."""
        rows, counts = self.token_ids.tolist(), self.num_emitted.tolist()
        return [row[:count] for row, count in zip(rows, counts)]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor | Sequence[bool] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> RejectionOutput:
    """Verify B padded drafts against the target in one batched pass (contract: the module docstring).

    draft_token_ids:  [B, K] int, sequence b's drafts in ``[:n_b]``, padding after.
    num_draft_tokens: [B] int, ``n_b`` in ``[0, K]``.
    draft_probs:      [B, K, V_q] float, or None (one-hot at the drafted tokens).
    target_probs:     [B, K+1, V_p] float; rows sum to 1 (within rounding) at positions ``<= n_b``.
    is_greedy:        [B] bool (default all False).
    generators:       B entries, a ``torch.Generator`` on the probabilities' device or None.
    """
    if draft_token_ids.dim() != 2 or target_probs.dim() != 3:
        raise ValueError("draft_token_ids must be [B, K] and target_probs [B, K+1, V]")
    B, K = draft_token_ids.shape
    if tuple(target_probs.shape[:2]) != (B, K + 1):
        raise ValueError(f"target_probs must be [{B}, {K + 1}, V], got {list(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape[:2]) != (B, K):
        raise ValueError(f"draft_probs must be [{B}, {K}, V], got {list(draft_probs.shape)}")
    device = target_probs.device
    V_p = target_probs.shape[2]
    p = target_probs.float()  # [B, K+1, V_p]
    n = torch.as_tensor(num_draft_tokens, dtype=torch.long, device=device).reshape(B)  # [B]
    if B and (int(n.min()) < 0 or int(n.max()) > K):
        raise ValueError(f"num_draft_tokens must be in [0, {K}]")
    greedy = (torch.zeros(B, dtype=torch.bool, device=device) if is_greedy is None
              else torch.as_tensor(is_greedy, dtype=torch.bool, device=device).reshape(B))  # [B]
    if generators is not None and len(generators) != B:
        raise ValueError("generators must have one entry (or None) per sequence")
    seeded = [] if generators is None else [b for b, g in enumerate(generators) if g is not None]
    greedy_list = greedy.tolist() if seeded else []
    n_list = n.tolist() if seeded else []
    rows = torch.arange(B, device=device)  # [B]
    draft = draft_token_ids.to(device=device, dtype=torch.long)  # [B, K]
    valid = torch.arange(K, device=device).unsqueeze(0) < n.unsqueeze(1)  # [B, K]

    # p_j(x) and q_j(x) at the drafted tokens; out-of-vocabulary ids get probability 0.
    p_draft = _gather_token(p[:, :K], draft)  # [B, K]
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else _gather_token(draft_probs.float(), draft))  # [B, K]
    target_argmax = p.argmax(dim=-1)  # [B, K+1]

    u = torch.rand(B, K, device=device)  # [B, K]
    # P(u < p/q) = min(1, p/q); never a token the target rules out (p = 0), whatever q came with it
    accept_sampled = (u * q_draft < p_draft) & (p_draft > 0)  # [B, K]
    accept_greedy = draft == target_argmax[:, :K]  # [B, K]
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_sampled) & valid  # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B], length of the leading accepted run

    # The one more token: from the residual at the first rejection, else the bonus from p_{n_b}.
    j = num_accepted  # [B], its position
    p_final = p[rows, j]  # [B, V_p]
    final_probs = p_final
    if K > 0:
        rejected = num_accepted < n  # [B]
        jd = j.clamp(max=K - 1)  # [B]
        if draft_probs is None:
            q_final = _one_hot(draft[rows, jd], V_p)  # [B, V_p]
        else:
            q_final = _fit_vocab(draft_probs[rows, jd].float(), V_p)  # [B, V_p]
        # unnormalized; a q below 0 (no distribution: a corrupted answer) must not lift a token the target rules out
        residual = (p_final - q_final.clamp_min(0.0)).clamp_min(0.0)  # [B, V_p]
        # A residual with no mass means p <= q everywhere, i.e. p == q up to rounding, where rejection has
        # probability 0: it can only come from rounding, and p is then the right distribution.
        use_residual = rejected & (residual.sum(dim=-1) > 0)  # [B]
        final_probs = torch.where(use_residual.unsqueeze(1), residual, p_final)  # [B, V_p]
    sampled_final = draw_rows(final_probs, [None] * B)  # [B]
    final = torch.where(greedy, target_argmax[rows, j], sampled_final)  # [B]
    for b in seeded:
        if not greedy_list[b]:
            num_accepted[b], final[b] = _coupled(p[b], draft[b], n_list[b], generators[b])
    j = num_accepted

    token_ids = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)  # [B, K+1]
    keep = torch.arange(K, device=device).unsqueeze(0) < num_accepted.unsqueeze(1)  # [B, K]
    token_ids[:, :K] = torch.where(keep, draft, PLACEHOLDER_TOKEN_ID)
    token_ids[rows, j] = final
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)


def _coupled(p: torch.Tensor, draft: torch.Tensor, n: int, generator: torch.Generator) -> tuple[int, int]:
    """A seeded row (the module docstring): p [K+1, V], draft [K]. Draws the target's token at positions 0..n,
    one uniform each, until one differs from the draft; returns (drafts kept, the token emitted after them)."""
    for position in range(n + 1):
        token = int(draw_rows(p[position:position + 1], [generator])[0])
        if position == n or token != int(draft[position]):
            return position, token
    raise AssertionError("unreachable: position n always returns")


def padded_from_packed(
    packed: torch.Tensor, counts: torch.Tensor | Sequence[int], width: int | None = None
) -> torch.Tensor:
    """Rows of B sequences laid one after another -> one padded row block per sequence.

    packed: [T, *F] with ``T = sum(counts)``; sequence b owns ``counts[b]`` consecutive rows.
    Returns [B, width, *F] (width defaults to ``max(counts)``), zeros past each sequence's rows.
    E.g. target logits for ``n_b + 1`` positions per sequence -> ``[B, K+1, V]`` with ``width = K + 1``.
    """
    device = packed.device
    counts_t = torch.as_tensor(counts, dtype=torch.long, device=device).reshape(-1)  # [B]
    B = counts_t.numel()
    if int(counts_t.sum()) != packed.shape[0]:
        raise ValueError(f"counts sum to {int(counts_t.sum())}, packed has {packed.shape[0]} rows")
    if width is None:
        width = int(counts_t.max()) if B else 0
    if B and int(counts_t.max()) > width:
        raise ValueError("width is smaller than the longest sequence")
    out = packed.new_zeros((B, width, *packed.shape[1:]))  # [B, W, *F]
    if packed.shape[0] == 0:
        return out
    starts = torch.cumsum(counts_t, dim=0) - counts_t  # [B]
    pos = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
    mask = pos < counts_t.unsqueeze(1)  # [B, W]
    index = (starts.unsqueeze(1) + pos).clamp(max=packed.shape[0] - 1)  # [B, W]
    out[mask] = packed[index[mask]]
    return out


def _gather_token(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [B, K, V], tokens [B, K] -> probs at the tokens [B, K]; 0 where a token is outside [0, V)."""
    V = probs.shape[-1]
    inside = (tokens >= 0) & (tokens < V)  # [B, K]
    picked = probs.gather(2, tokens.clamp(0, V - 1).unsqueeze(2)).squeeze(2)  # [B, K]
    return torch.where(inside, picked, torch.zeros_like(picked))


def _one_hot(tokens: torch.Tensor, V: int) -> torch.Tensor:
    """tokens [B] -> [B, V] float one-hot; all zeros where a token is outside [0, V)."""
    inside = (tokens >= 0) & (tokens < V)  # [B]
    out = torch.zeros(tokens.shape[0], V, device=tokens.device)  # [B, V]
    out.scatter_(1, tokens.clamp(0, V - 1).unsqueeze(1), inside.float().unsqueeze(1))
    return out


def _fit_vocab(q: torch.Tensor, V_p: int) -> torch.Tensor:
    """q [B, V_q] on the target's vocabulary [B, V_p]: mass beyond V_p dropped, ids beyond V_q at 0."""
    V_q = q.shape[-1]
    if V_q >= V_p:
        return q[:, :V_p]
    return torch.nn.functional.pad(q, (0, V_p - V_q))
