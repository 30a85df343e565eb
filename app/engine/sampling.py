"""A vectorized sampler: one call turns a batch of logits into one token per request.

Each row carries its own parameters (temperature, top-p/k, min-p, penalties, seed, min_tokens),
so greedy and sampled requests share a batch. Order of operations follows vLLM's sampler:
penalties on raw logits, the grammar's mask (structured outputs), min_tokens masking, temperature,
min-p against the top probability, top-k, then top-p over what those left, renormalized.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from app.cpu.argmax import argmax_rows
from app.engine.grammar import Grammars, consume
from app.engine.request import Request, SamplingParams, SparseProbs, TokenLogprob

_NEG_INF = float("-inf")


class Sampler:
    def __init__(self, grammars: Grammars | None = None) -> None:
        self.grammars = grammars  # structured outputs (None: an engine without a tokenizer takes no grammar)
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
        # With logprobs asked, the masks go on a copy and the caller's rows stay raw: rows sampled again alone after a
        # batch-mate failed (runner._isolated) then give the same logprobs as in the batch.
        raw = logits if any(r.sampling.logprobs is not None for r in requests) else None
        tokens, sampled_from = self._sample(logits.clone() if raw is not None else logits, requests)
        logprobs = token_logprobs(raw, tokens, requests) if raw is not None else [None] * len(requests)
        for row, (ids, probs) in sampled_from.items():  # draft calls: what the target will verify against
            logprobs[row] = TokenLogprob(tokens[row], math.log(probs[ids.index(tokens[row])]), [], (ids, probs))
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], dict[int, SparseProbs]]:
        # Penalties are written in place: on a copy, so that rows sampled again alone (runner._isolated) are not
        # penalized twice. The min_tokens mask is written in place on the caller's rows (setting -inf twice is
        # the same; a copy of every row each step of a min_tokens request is not free).
        if any(has_penalty(r) for r in requests):
            logits = logits.clone()
        logits = apply_penalties(logits, requests)
        if self.grammars is not None:  # in place, as the min_tokens mask: the same grammar state masks the same tokens
            logits = self.grammars.mask(logits, requests)
        logits = mask_stop_tokens_before_min(logits, requests)  # after the grammar: it yields where only EOS is left
        greedy_tokens = argmax_rows(logits)  # [B]
        require_a_token(logits.gather(1, greedy_tokens.unsqueeze(1)), requests)  # each row's largest logit
        if all(r.sampling.greedy for r in requests):
            return greedy_tokens.tolist(), {}
        probs = truncated_probs(logits, requests)  # [B, V]
        sampled_from = keep_draft_top_n(probs, requests)
        sampled = self._draw(probs, requests)  # [B]
        is_greedy = torch.tensor([r.sampling.greedy for r in requests], device=logits.device)
        return torch.where(is_greedy, greedy_tokens, sampled).tolist(), sampled_from

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        generators = [self.generator_for(r, probs.device) if r.sampling.seed is not None and not r.sampling.greedy else None
                      for r in requests]
        return draw_rows(probs, generators)

    def admit(self, request: Request, device: torch.device) -> None:
        """Make a seeded request's generator as it is admitted: a seed no generator takes (not an integer, past the
        API's checks) fails that request there, never the batched step it would join."""
        if request.sampling.seed is not None and not request.sampling.greedy:
            self.generator_for(request, device)
        if request.sampling.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine takes no structured outputs")
            request.matcher = self.grammars.matcher(request.sampling.grammar)
            for token_id in request.output_token_ids:  # one that comes with output (a draft call: the target's so far)
                consume(request, token_id)             # continues the grammar from there, not from its start

    def generator_states(self, requests: Sequence[Request]) -> dict[str, torch.Tensor]:
        """The seeded requests' generators' states (restore_generator_states puts them back)."""
        return {r.request_id: g.get_state() for r in requests if (g := self._generators.get(r.request_id)) is not None}

    def restore_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        for request_id, state in states.items():
            self._generators[request_id].set_state(state)

    def generator_for(self, request: Request, device: torch.device) -> torch.Generator:
        """The request's own generator (made at admission, or on first use; for seeded requests only)."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(mixed_seed(request.sampling.seed))
            self._generators[request.request_id] = generator
        return generator


def mixed_seed(seed: int) -> int:
    """A generator's seed from a request's 64-bit one (splitmix64's finalizer, a bijection): a CPU generator keeps only
    its seed's low 32 bits, which then depend on all 64 (5 and 5 + 2**32, -2 and 2**32 - 2 are different streams)."""
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def draw_rows(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``weights`` [B, V] (non-negative, not necessarily summing to 1), drawn with probability
    proportional to its weight: the row's cumulative weights (float64) inverted at one uniform draw. A row with a
    generator draws its uniform from it, and nothing else, so its token does not depend on its batch; the other
    rows draw from torch's default generator. (One uniform per row: an exponential per token, as a Gumbel-style
    race needs, costs ~1 ms per row of a 49k vocabulary on a CPU.)"""
    B, V = weights.shape
    cumulative = weights.double().cumsum(dim=-1)  # [B, V]
    total = cumulative[:, -1:]  # [B, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):  # NaN logits, or nothing left to draw from
        raise ValueError("no token can be drawn: a row's probabilities are not finite or all zero (NaN logits?)")
    u = torch.rand(B, 1, dtype=torch.float64, device=weights.device)  # [B, 1]
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row] = torch.rand(1, dtype=torch.float64, device=weights.device, generator=generator)
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total: a real token
    return torch.searchsorted(cumulative, point, right=True).squeeze(1)  # [B]: the first token whose span holds it


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
    """OpenAI logit_bias, then (vLLM's order) HF repetition penalty over the prompt's and output's tokens, then
    frequency/presence penalties over the output's; then vLLM's bans: every token outside allowed_token_ids, and each
    bad word's last token where the output ends with the rest of it. In place, on the rows that ask."""
    rows = [i for i, r in enumerate(requests) if has_penalty(r)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for row in rows:  # penalties are rare; a loop keeps the common path free of [B, V] count tensors
        params = requests[row].sampling
        bias = [(token, value) for token, value in params.logit_bias if 0 <= token < vocab]
        if bias:
            ids, values = zip(*bias)
            logits[row, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(requests[row].all_token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            values = logits[row, seen]
            penalized = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            logits[row, seen] = penalized
        if params.frequency_penalty or params.presence_penalty:
            output = torch.tensor(requests[row].output_token_ids, dtype=torch.long, device=logits.device)
            output = output[output < vocab]
            counts = torch.bincount(output, minlength=vocab).to(logits.dtype)  # [V]
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        ban_tokens(logits[row], params, requests[row].output_token_ids)
    return logits


def ban_tokens(row: torch.Tensor, params: SamplingParams, output: Sequence[int]) -> None:
    """``row``: [V] logits, in place. A token banned here is -inf, whatever a bias or penalty made it."""
    vocab = row.shape[-1]
    if params.allowed_token_ids:
        allowed = params.allowed_index(row.device)
        allowed = allowed[allowed < vocab] if params.allowed_token_ids[-1] >= vocab else allowed  # sorted: the last the largest
        kept = row.index_select(0, allowed)
        row.fill_(_NEG_INF)
        row.index_copy_(0, allowed, kept)
    for word in params.bad_words_token_ids:  # as vLLM: the output's last len(word) - 1 tokens against the word's first
        *prefix, last = word
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix and 0 <= last < vocab:
            row[last] = _NEG_INF


def has_penalty(request: Request) -> bool:
    """Whether the request's logits are changed before sampling (a bias or a penalty)."""
    p = request.sampling
    return (p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0 or bool(p.logit_bias)
            or bool(p.allowed_token_ids) or bool(p.bad_words_token_ids))


def mask_stop_tokens_before_min(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Until min_tokens are out, EOS and stop token ids cannot be chosen, unless the request's grammar allows nothing
    else: a complete structured output (a closed JSON object, one of the choices) ends there, min_tokens or not."""
    for row, request in enumerate(requests):
        if request.num_output_tokens < request.sampling.min_tokens:
            banned = set(request.sampling.stop_token_ids) | request.eos_token_ids  # ignore_eos too, as vLLM
            banned_ids = [t for t in banned if 0 <= t < logits.shape[-1]]
            if banned_ids:
                kept = logits[row, banned_ids].clone()
                logits[row, banned_ids] = _NEG_INF
                if request.matcher is not None and not bool(torch.isfinite(logits[row]).any()):
                    logits[row, banned_ids] = kept
    return logits


class NoTokenLeftError(ValueError):
    """Every token of a request's row is banned: its allowed_token_ids, bad_words, min_tokens' stop tokens and grammar
    together leave none (the model's logits were finite): the request's to change."""


def require_a_token(chosen: torch.Tensor, requests: Sequence[Request]) -> None:
    """chosen: [B, 1], each row's largest logit after the masks. -inf: every token was banned (NoTokenLeftError); NaN
    or +inf: the model's logits were not finite (ValueError). Either fails that request alone (the runner samples its
    batch-mates again without it)."""
    values = chosen.squeeze(1).tolist()
    require_finite(values, requests)
    for request, value in zip(requests, values):
        if value == _NEG_INF:
            raise no_token_left(request)


def require_finite(values: Sequence[float], requests: Sequence[Request]) -> None:
    """Each row's largest logit after the masks (-inf: every token banned, the caller's to judge); NaN or +inf: the
    model's logits were not finite (ValueError)."""
    for request, value in zip(requests, values):
        if value != _NEG_INF and not math.isfinite(value):
            raise ValueError(f"no token can be chosen for request {request.request_id}: its logits are not finite (NaN or inf)")


def no_token_left(request: Request) -> NoTokenLeftError:
    """The error of a request with every token banned at its next output token (``request`` as it stands there)."""
    return NoTokenLeftError(f"request {request.request_id}: its allowed_token_ids, bad_words, min_tokens' stop tokens and "
                            f"format together ban every token at output token {request.num_output_tokens + 1}")


# Top-k / top-p keep a prefix of the tokens by probability; it is looked for among this many of the most likely
# (a partial sort), then among more for a row whose prefix runs past them, and only then in the whole row.
_CANDIDATES = (256, 4096)


def truncated_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p truncation, as vLLM's sampler; returns probabilities [B, V].

    A row keeps its most likely token and each next most likely one while its probability is at least min-p
    times the top one's, it is at least the k-th largest (ties with it kept, as vLLM and HF keep them), and the mass
    before it is less than top-p of the mass min-p and top-k keep (top-p over their renormalized probabilities, as
    vLLM and HF chain them). Rows with neither top-k nor top-p are never sorted; the others rank their 256 most likely
    tokens only, unless their kept prefix reaches past them, or their top-k does beside a top-p (then 4096, then all).
    (A full sort of a 49k vocabulary costs ~3 ms a row on a CPU: as much as a step; its top 256 ~0.1 ms, its top
    4096 ~0.6 ms.)
    """
    device = logits.device
    V = logits.shape[-1]
    temperature = torch.tensor([max(r.sampling.temperature, 1e-5) for r in requests], device=device)
    logits = logits / temperature.unsqueeze(1)  # [B, V]
    probs = logits.softmax(dim=-1)  # [B, V]
    ranked = [i for i, r in enumerate(requests) if 0 < r.sampling.top_k < V or r.sampling.top_p < 1]
    if not ranked and all(r.sampling.min_p == 0 for r in requests):
        return probs  # nothing to truncate
    # (each rule keeps the most likely token: the top probability, the largest, no mass before it)
    floor, keep = None, torch.ones_like(probs, dtype=torch.bool)  # [B, V]
    if any(r.sampling.min_p > 0 for r in requests):
        min_p = torch.tensor([r.sampling.min_p for r in requests], device=device)
        floor = (min_p * probs.max(dim=-1).values).unsqueeze(1)  # [B, 1]: min-p's least probability kept (0: none)
        keep = probs >= floor
    if ranked:
        keep[ranked] &= _prefix_kept(probs[ranked], None if floor is None else floor[ranked], [requests[i] for i in ranked])
    return logits.masked_fill(~keep, _NEG_INF).softmax(dim=-1)


def _prefix_kept(probs: torch.Tensor, floor: torch.Tensor | None, requests: Sequence[Request]) -> torch.Tensor:
    """[R, V] bool: the tokens top-k and top-p keep (a prefix of each row by probability); ``floor`` [R, 1] (None: no
    min-p): min-p's least probability kept, whose survivors (and top-k's) top-p's mass is a share of."""
    R, V = probs.shape
    device = probs.device
    top_k = torch.tensor([r.sampling.top_k if 0 < r.sampling.top_k < V else V for r in requests], device=device)
    # top_p = 1 keeps everything (a cumulative sum can pass 1.0 by rounding and would drop the tail)
    top_p = torch.tensor([r.sampling.top_p if r.sampling.top_p < 1 else math.inf for r in requests], device=device)
    # Without top-k, the mass top-p shares out is min-p's survivors' (1 without min-p): no sort needed for it
    survivors = torch.ones(R, device=device)  # [R]
    if floor is not None:
        needed = [i for i, r in enumerate(requests) if r.sampling.min_p > 0 and top_k[i] == V and r.sampling.top_p < 1]
        survivors[needed] = probs[needed].masked_fill(probs[needed] < floor[needed], 0.0).sum(dim=-1)
    out = torch.zeros_like(probs, dtype=torch.bool)  # [R, V]
    rows = torch.arange(R, device=device)  # the rows whose prefix is not found yet
    for width in (*(w for w in _CANDIDATES if w < V), V):
        values, ids = probs[rows].topk(width, dim=-1)  # [r, W], most likely first
        k = top_k[rows]
        kth = values.gather(1, (k - 1).clamp(max=width - 1).unsqueeze(1))  # [r, 1]: the k-th largest, where in the window
        limited = values >= torch.where(k.unsqueeze(1) <= width, kth, _NEG_INF)  # [r, W]: what top-k keeps (its ties too)
        if floor is not None:
            limited &= values >= floor[rows]  # and min-p
        unbounded = limited[:, -1] & (width < V)  # min-p's and top-k's prefix runs past the window: its mass is not known
        mass = torch.where(k < V, values.masked_fill(~limited, 0.0).sum(dim=-1), survivors[rows])  # [r]
        kept = limited & (values.cumsum(dim=-1) - values < top_p[rows].unsqueeze(1) * mass.unsqueeze(1))  # [r, W]
        kept[:, 0] = limited[:, 0]  # the most likely token stays whatever top_p (as vLLM: 1e-46 is 0 in float32)
        out[rows] = torch.zeros(len(rows), V, dtype=torch.bool, device=device).scatter_(1, ids, kept)
        rows = rows[kept[:, -1] | (unbounded & (k < V))]  # a prefix that fills the window may go on past it
        if width == V or len(rows) == 0:
            break
    return out
