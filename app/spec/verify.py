"""Verify a step's drafts against the target's logits: the runner's side of speculative decoding.

The runner computes, for a sequence that drafted ``n`` tokens, ``n + 1`` rows of logits in the step's packed
forward (its last token and each draft predict the next token). Each position is judged by the request as
it would stand after the drafts before it (penalties and min_tokens count them, ``probs.position_request``):

- a greedy request keeps the drafts equal to the target's greedy choice at their position, then takes that
  choice: exactly its output without drafts. Done on the logits in place (argmax, no probabilities): the
  cheap path, which batches of greedy requests take every step.
- a sampled request goes through the lossless rejection sampler (``rejection.py``) on the distributions the
  engine's sampler would draw from (``probs.processed_probs``), with its own generator when seeded. Its q is
  the distribution each draft was sampled from where the drafter sent one (a draft model's few most likely
  tokens), else one-hot at the draft (n-gram drafts, chosen rather than sampled).

A position where every token is banned (NoTokenLeftError: the request's bans) fails the request where it is reached.
Past an accepted draft it may not be: a draft before it can finish the request (a stop token, a stop string, its
length), which only the engine's stop checks see. There the drafts before it are emitted, the last as the step's own
token: the engine stops the request on them, or its next step samples that position and fails it there.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from app.cpu.argmax import argmax_rows
from app.engine.request import Request, SparseProbs
from app.engine.sampling import apply_penalties, mask_stop_tokens_before_min, no_token_left, require_finite
from app.spec.probs import position_request, processed_probs
from app.spec.rejection import padded_from_packed, rejection_sample


def verify_drafts(
    rows: torch.Tensor,  # [sum(n_b + 1), V] logits, sequence after sequence; modified in place
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],  # sequence b's n_b drafted tokens
    generators: Sequence[torch.Generator | None],  # a seeded sampled request's own generator, else None
    draft_probs: Sequence[Sequence[SparseProbs] | None] | None = None,  # what sequence b's drafts were drawn from
) -> tuple[list[list[int]], list[int]]:
    """Each sequence's emitted tokens (accepted drafts, then one more) and how many drafts it kept."""
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    emitted: list[list[int]] = [[] for _ in requests]
    accepted = [0] * len(requests)
    greedy = [b for b, r in enumerate(requests) if r.sampling.greedy]
    sampled = [b for b, r in enumerate(requests) if not r.sampling.greedy]
    if greedy:
        _verify_greedy(rows, requests, drafts, starts, greedy, emitted, accepted)
    if sampled:
        probs = draft_probs if draft_probs is not None else [None] * len(requests)
        _verify_sampled(rows, requests, drafts, starts, sampled, generators, probs, emitted, accepted)
    return emitted, accepted


def _stop_short(b: int, reached: int, requests, drafts, emitted, accepted) -> None:
    """Sequence b's position ``reached`` (at most its drafts kept) has every token banned: the drafts before it go out,
    the last as the step's own token; with none before it the request fails now."""
    if reached == 0:
        raise no_token_left(requests[b])
    emitted[b], accepted[b] = list(drafts[b][:reached]), reached - 1


def _verify_greedy(rows, requests, drafts, starts, chosen, emitted, accepted) -> None:
    index = [row for b in chosen for row in range(starts[b], starts[b + 1])]
    logits = rows if len(index) == rows.shape[0] else rows[index]  # [G, V]
    logits = logits.float()  # the sampler's precision: penalties and biases on bf16 logits round otherwise
    position_requests = [position_request(requests[b], list(drafts[b][:j])) for b in chosen for j in range(len(drafts[b]) + 1)]
    logits = mask_stop_tokens_before_min(apply_penalties(logits, position_requests), position_requests)
    picks = argmax_rows(logits.contiguous())  # [G]: the sampler's greedy choice at every position
    tops = logits.gather(1, picks.unsqueeze(1))  # [G, 1]
    targets = picks.tolist()
    at = 0
    for b in chosen:
        n = len(drafts[b])
        choice = targets[at : at + n + 1]
        kept = 0
        while kept < n and drafts[b][kept] == choice[kept]:
            kept += 1
        # the positions emitted (past a rejected draft none is): one with every token banned fails the request alone
        values = tops[at : at + kept + 1].squeeze(1).tolist()
        require_finite(values, position_requests[at : at + kept + 1])
        emitted[b], accepted[b] = choice[: kept + 1], kept
        if float("-inf") in values:
            _stop_short(b, values.index(float("-inf")), requests, drafts, emitted, accepted)
        at += n + 1


def _verify_sampled(rows, requests, drafts, starts, chosen, generators, draft_probs, emitted, accepted) -> None:
    counts = [len(drafts[b]) for b in chosen]
    width = max(counts) + 1
    index = [row for b in chosen for row in range(starts[b], starts[b + 1])]
    logits = padded_from_packed(rows[index], [n + 1 for n in counts], width)  # [B, K+1, V]
    draft_ids = torch.tensor([list(drafts[b]) + [0] * (width - 1 - len(drafts[b])) for b in chosen], dtype=torch.long)  # [B, K]
    subset = [requests[b] for b in chosen]
    dead: list[int] = []  # positions with every token banned (a stand-in there): the request fails if it reaches one
    target = processed_probs(logits, subset, draft_ids, counts, dead=dead)  # [B, K+1, V]
    sent = [draft_probs[b] for b in chosen]
    q = dense_draft_probs(draft_ids, counts, sent, target.shape[-1]).to(target.device) if any(p is not None for p in sent) else None
    out = rejection_sample(draft_ids, counts, q, target, is_greedy=[False] * len(chosen),
                           generators=[generators[b] for b in chosen])
    for k, (b, tokens, kept) in enumerate(zip(chosen, out.tolist(), out.num_accepted.tolist())):
        reached = next((j for j in range(kept + 1) if k * width + j in dead), None)
        emitted[b], accepted[b] = tokens, kept
        if reached is not None:
            _stop_short(b, reached, requests, drafts, emitted, accepted)


def dense_draft_probs(draft_ids: torch.Tensor, counts: Sequence[int], sent: Sequence[Sequence[SparseProbs] | None],
                      vocab_size: int) -> torch.Tensor:
    """[B, K, V] q for the rejection sampler: each position's sent distribution, or one-hot at its draft where
    none was sent or the draft is not in it (one-hot is lossless for any draft; a distribution that did not
    produce the token is not). Ids past the target's vocabulary are dropped: the target never emits them."""
    B, K = draft_ids.shape
    q = torch.zeros(B, K, vocab_size)  # [B, K, V]
    for b in range(B):
        for j in range(counts[b]):
            token = int(draft_ids[b, j])
            ids, values = sent[b][j] if sent[b] is not None else ([], [])
            if token not in ids:
                ids, values = [token], [1.0]
            inside = [(i, v) for i, v in zip(ids, values) if 0 <= i < vocab_size]
            if inside:
                q[b, j, [i for i, _ in inside]] = torch.tensor([v for _, v in inside])
    return q
