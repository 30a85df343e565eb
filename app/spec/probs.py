"""Logits -> the request's processed distribution, by the engine sampler's own steps, for p and q.

Rejection sampling is lossless only if the target probabilities p and the draft probabilities q are the
distributions the engine would sample from: penalties on the raw logits, min_tokens masking,
temperature, then min-p, top-k and top-p (``app/engine/sampling.py``). This module does not reimplement
any of that: it calls the sampler's own steps (``apply_penalties``, ``mask_stop_tokens_before_min``,
``truncated_probs``; ``has_penalty``), which take a batch of ``Request`` rows.

What a speculative position adds is the context: the distribution at draft position ``j`` is the one the
request would have after emitting ``draft[:j]``, so penalties count those tokens and min_tokens counts
them as output. Each (sequence, position) row is therefore processed as a copy of the request whose
``output_token_ids`` end with ``draft[:j]`` (only for requests with penalties or an unmet min_tokens;
others are used as they are).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from app.engine.request import Request
from app.engine.sampling import apply_penalties, has_penalty, mask_stop_tokens_before_min, require_a_token, truncated_probs


def processed_probs(
    logits: torch.Tensor,
    requests: Sequence[Request],
    draft_token_ids: torch.Tensor | Sequence[Sequence[int]] | None = None,
    num_draft_tokens: torch.Tensor | Sequence[int] | None = None,
    vocab_size: int | None = None,
    dead: list[int] | None = None,
) -> torch.Tensor:
    """Processed probabilities for every (sequence, position) row.

    logits:           [B, S, V] (or [B, V], treated as S = 1), any float dtype; not modified.
    requests:         B requests; their sampling params, output tokens and eos ids as they stand now.
    draft_token_ids:  [B, >= S-1] tokens drafted after the request's current output (needed when S > 1).
    num_draft_tokens: [B] how many of each row's draft tokens are real (default: all of them); position
                      ``j`` sees ``draft[b, :min(j, n_b)]``, so padding never enters a penalty.
    vocab_size:       if given, logits at ids ``>= vocab_size`` (a padded output head) get probability 0.
    dead:             if given, filled with the flat rows (b * S + j) where the bans leave no token, which get a
                      stand-in one-hot at token 0: verification reaches such a position only past drafts it kept, and
                      stops the sequence short there (verify.py); if not given, any such row raises NoTokenLeftError.

    Returns float32 [B, S, V] (or [B, V] for 2-D input). Sampled rows (not ``greedy``) are the sampler's
    truncated softmax. Greedy rows are a one-hot at the token the engine's greedy sampler would pick
    (argmax after penalties and min_tokens masking), so argmax of the result is that token exactly.
    """
    squeeze = logits.dim() == 2
    x = logits.unsqueeze(1) if squeeze else logits  # [B, S, V]
    B, S, V = x.shape
    if len(requests) != B:
        raise ValueError(f"{len(requests)} requests for {B} rows of logits")
    drafts = _as_lists(draft_token_ids, B)
    counts = ([len(d) for d in drafts] if num_draft_tokens is None
              else [int(c) for c in torch.as_tensor(num_draft_tokens).reshape(B).tolist()])
    if S > 1 and draft_token_ids is None:
        raise ValueError("draft_token_ids are needed for more than one position")
    if any(c < 0 or c > len(d) for d, c in zip(drafts, counts)):
        raise ValueError("num_draft_tokens must be in [0, len(draft_token_ids[b])]")

    rows = [position_request(requests[b], drafts[b][: min(j, counts[b])]) for b in range(B) for j in range(S)]
    flat = x.reshape(B * S, V).to(torch.float32, copy=True)  # [B*S, V], ours to modify in place
    if vocab_size is not None and vocab_size < V:
        flat[:, vocab_size:] = float("-inf")
    flat = apply_penalties(flat, rows)  # [B*S, V]
    flat = mask_stop_tokens_before_min(flat, rows)  # [B*S, V]
    tops = flat.amax(dim=-1, keepdim=True)  # [B*S, 1]
    banned = (tops == float("-inf")).squeeze(1)  # [B*S]: every token banned
    if dead is None or not bool(banned.any()):
        require_a_token(tops, rows)
    else:
        require_a_token(tops[~banned], [r for r, b in zip(rows, banned.tolist()) if not b])  # NaN: the model's failure
        dead.extend(banned.nonzero().squeeze(1).tolist())
        flat[banned, 0] = 0.0

    greedy = torch.tensor([r.sampling.greedy for r in rows], dtype=torch.bool, device=flat.device)  # [B*S]
    probs = torch.zeros_like(flat)  # [B*S, V]
    if bool(greedy.any()):
        g_rows = greedy.nonzero().squeeze(1)  # [G]
        probs[g_rows, flat[g_rows].argmax(dim=-1)] = 1.0
    if not bool(greedy.all()):
        s_rows = (~greedy).nonzero().squeeze(1)  # [R]
        probs[s_rows] = truncated_probs(flat[s_rows], [rows[i] for i in s_rows.tolist()])  # [R, V]
    probs = probs.reshape(B, S, V)
    return probs.squeeze(1) if squeeze else probs


def _needs_context(request: Request) -> bool:
    """Whether the tokens already emitted change this request's distribution (penalties, min_tokens)."""
    return has_penalty(request) or request.num_output_tokens < request.sampling.min_tokens


def position_request(request: Request, prefix: list[int]) -> Request:
    """The request as it would stand after emitting ``prefix`` (itself when that changes nothing)."""
    if not prefix or not _needs_context(request):
        return request
    return dataclasses.replace(request, output_token_ids=request.output_token_ids + prefix)


def _as_lists(tokens: torch.Tensor | Sequence[Sequence[int]] | None, B: int) -> list[list[int]]:
    if tokens is None:
        return [[] for _ in range(B)]
    rows = tokens.tolist() if isinstance(tokens, torch.Tensor) else [list(t) for t in tokens]
    if len(rows) != B:
        raise ValueError(f"draft_token_ids has {len(rows)} rows for {B} requests")
    return [[int(t) for t in row] for row in rows]
