"""A vectorized sampler: one call turns a batch of logits into one token per request.

Each row carries its own parameters (temperature, top-p/k, min-p, penalties, seed, min_tokens),
so greedy and sampled requests share a batch. Order of operations follows vLLM and HF:
penalties on raw logits, min_tokens masking, temperature, then top-k / top-p / min-p truncation.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from app.cpu.argmax import argmax_rows
from app.engine.request import Request, SparseProbs, TokenLogprob

_NEG_INF = float("-inf")


class Sampler:
    def __init__(self) -> None:
        # A seeded request draws from its own generator, so its output does not depend on
        # which other requests share its batch. Keyed by request id, dropped when it finishes.
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logits: [B, V] for the next position of each request -> one token id per request."""
        return self.sample_with_logprobs(logits, requests)[0]

    def sample_with_logprobs(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample, and for requests that ask, the sampled token's logprob under the model's raw distribution."""
        logits = logits.float()  # [B, V]
        raw = logits.clone() if any(r.sampling.logprobs is not None for r in requests) else None
        tokens, sampled_from = self._sample(logits, requests)
        logprobs = token_logprobs(raw, tokens, requests) if raw is not None else [None] * len(requests)
        for row, (ids, probs) in sampled_from.items():  # draft calls: what the target will verify against
            logprobs[row] = TokenLogprob(tokens[row], math.log(probs[ids.index(tokens[row])]), [], (ids, probs))
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], dict[int, SparseProbs]]:
        logits = apply_penalties(logits, requests)
        logits = mask_stop_tokens_before_min(logits, requests)
        greedy_tokens = argmax_rows(logits)  # [B]
        if all(r.sampling.greedy for r in requests):
            return greedy_tokens.tolist(), {}
        probs = truncated_probs(logits, requests)  # [B, V]
        sampled_from = keep_draft_top_n(probs, requests)
        sampled = self._draw(probs, requests)  # [B]
        is_greedy = torch.tensor([r.sampling.greedy for r in requests], device=logits.device)
        return torch.where(is_greedy, greedy_tokens, sampled).tolist(), sampled_from

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and lets each row
        # use its own generator without a Python loop over the vocabulary.
        noise = torch.empty_like(probs).exponential_()  # [B, V]
        for row, request in enumerate(requests):
            if request.sampling.seed is not None and not request.sampling.greedy:
                noise[row].exponential_(generator=self.generator_for(request, probs.device))
        return argmax_rows(probs / noise)

    def generator_for(self, request: Request, device: torch.device) -> torch.Generator:
        """The request's own generator (made from its seed on first use; for seeded requests only)."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(request.sampling.seed)
            self._generators[request.request_id] = generator
        return generator


def keep_draft_top_n(probs: torch.Tensor, requests: Sequence[Request]) -> dict[int, SparseProbs]:
    """Rows of draft calls (``draft_top_n``) keep their n most likely tokens, renormalized, in place; returns
    each such row's distribution as sent to the target. Verification is lossless for any distribution the
    draft token was truly drawn from, and n tokens cross the network in a few hundred bytes, where the whole
    vocabulary would not; the mass cut off is small, and only costs acceptance."""
    chosen: dict[int, SparseProbs] = {}
    for row, request in enumerate(requests):
        top_n = request.sampling.draft_top_n
        if not top_n or request.sampling.greedy:
            continue
        values, ids = probs[row].topk(min(top_n, probs.shape[-1]))  # [n]
        keep = values > 0  # truncation (top-p, top-k, min-p) may have left fewer than n
        values, ids = values[keep] / values[keep].sum(), ids[keep]
        probs[row].zero_()
        probs[row, ids] = values
        chosen[row] = (ids.tolist(), values.tolist())
    return chosen


def token_logprobs(raw: torch.Tensor, tokens: list[int], requests: Sequence[Request]) -> list[TokenLogprob | None]:
    """Logprobs from the unprocessed logits (as vLLM and OpenAI report them), only for rows that asked."""
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    logprobs = raw[rows].log_softmax(dim=-1)  # [R, V]
    result: list[TokenLogprob | None] = [None] * len(requests)
    for k, row in enumerate(rows):
        count = requests[row].sampling.logprobs
        top_values, top_ids = logprobs[k].topk(count) if count else (logprobs[k][:0], logprobs[k][:0].long())
        top = list(zip(top_ids.tolist(), top_values.tolist()))
        result[row] = TokenLogprob(tokens[row], float(logprobs[k, tokens[row]]), top)
    return result


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over output tokens; HF repetition penalty over all tokens."""
    rows = [i for i, r in enumerate(requests) if has_penalty(r)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for row in rows:  # penalties are rare; a loop keeps the common path free of [B, V] count tensors
        params = requests[row].sampling
        output = torch.tensor(requests[row].output_token_ids, dtype=torch.long, device=logits.device)
        output = output[output < vocab]
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)  # [V]
        logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(requests[row].all_token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            values = logits[row, seen]
            penalized = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            logits[row, seen] = penalized
    return logits


def has_penalty(request: Request) -> bool:
    p = request.sampling
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0


def mask_stop_tokens_before_min(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Until min_tokens are out, EOS and stop token ids cannot be chosen."""
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.sampling.min_tokens:
            banned = set(request.sampling.stop_token_ids)
            if not request.sampling.ignore_eos:
                banned |= request.eos_token_ids
            banned_ids = [t for t in banned if 0 <= t < logits.shape[-1]]
            if banned_ids:
                logits[row, banned_ids] = _NEG_INF
    return logits


def truncated_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p truncation; returns probabilities [B, V]."""
    device = logits.device
    temperature = torch.tensor([max(r.sampling.temperature, 1e-5) for r in requests], device=device)
    logits = logits / temperature.unsqueeze(1)  # [B, V]
    top_k = torch.tensor([r.sampling.top_k or logits.shape[-1] for r in requests], device=device)
    top_p = torch.tensor([r.sampling.top_p for r in requests], device=device)
    min_p = torch.tensor([r.sampling.min_p for r in requests], device=device)

    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(logits.shape[-1], device=device).unsqueeze(0)  # [1, V]
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive cumsum: keeps the token crossing p
    drop |= mass_before > top_p.unsqueeze(1)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    truncated = torch.full_like(logits, _NEG_INF).scatter(1, sorted_idx, sorted_logits)
    return truncated.softmax(dim=-1)
