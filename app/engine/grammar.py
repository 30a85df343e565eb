"""Structured outputs in the engine: each constrained request's grammar (llguidance) masks, at every step, the
tokens that cannot continue a valid output, and consumes the token sampled.

A request carries its grammar as llguidance's serialized grammar (``SamplingParams.grammar``, made from a JSON
schema, a regex, a choice list or a Lark/GBNF grammar by ``app/api/structured.py``). At admission the engine
gives it a matcher: a copy of that grammar's compiled matcher, compiled once per grammar and kept (LRU), so a
schema many requests share is compiled once. A step computes the masks of all its constrained rows together
(llguidance's executor, in parallel, without the GIL) and applies them to those rows only; unconstrained rows
pay nothing. A grammar that reaches its end allows only EOS, so the request stops there.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from app.engine.bounded_cache import BoundedCache
from app.engine.deep_stack import on_a_deep_stack

# -inf as float32 bits: disallowed logits are overwritten with it by integer ops (a masked_fill over a 49k
# vocabulary costs ~4x more on a CPU).
_NEG_INF_BITS = int(torch.tensor(float("-inf")).view(torch.int32).item())
_CACHED_GRAMMARS = 256
_CACHED_GRAMMAR_CHARS = 64 << 20  # of the grammars' text in all (each up to a 4 MB request's schema)
# The parser items one step of a matcher may take (llguidance's default: 50,000). An ambiguous grammar's items grow
# with its output (`s: s s | "a" | "b"`: a mask ~0.5 s by its 340th token at the default, every batch-mate waiting);
# past this its request fails alone ("Too many items"), its steps held to ~30 ms (2-core AVX2 EPYC, SmolLM2's
# vocabulary). The largest grammars the API admits (490 optional properties, 1,999 choices, 128 strict tools) take
# fewer than 2,100.
STEP_MAX_ITEMS = 5000
# llguidance's view of each tokenizer (~1 s to build), shared by every engine of the process on that tokenizer
_LLG_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A request's grammar cannot be compiled or has reached a state no token continues."""


def _short(error: str) -> str:
    """llguidance's error without the parser state it appends (hundreds of lines, no use to a client)."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else "no token continues the grammar"
    return first[:300]


class Grammars:
    """One engine's grammar state: the tokenizer as llguidance sees it (made on first use, ~1 s, once per process),
    compiled grammars by their text, and the step's masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._eos_set = frozenset(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._compiled = BoundedCache(entries=_CACHED_GRAMMARS, size=_CACHED_GRAMMAR_CHARS)

    def matcher(self, grammar: str):
        """A fresh matcher for ``grammar`` (a copy of the compiled one, so requests never share state)."""
        import llguidance

        compiled = self._compiled.get(grammar)
        if compiled is None:
            tokenizer, limits = self._llg_tokenizer(), llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS)
            compiled = on_a_deep_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits))
            self._compiled.put(grammar, compiled, len(grammar))  # a failure too: a resent one costs no second compile
        if compiled.is_error():
            raise GrammarError(f"the grammar cannot be used: {_short(compiled.get_error())}")
        return compiled.deep_copy()

    def mask(self, logits: torch.Tensor, requests: Sequence) -> torch.Tensor:
        """Disallowed tokens of each constrained row set to -inf, in place; rows without a grammar untouched."""
        rows = [i for i, r in enumerate(requests) if r.matcher is not None]
        if not rows:
            return logits
        matchers = [requests[i].matcher for i in rows]
        bits, words = self._bitmasks(len(rows))
        if len(rows) == 1:
            matchers[0].unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
        else:
            self._parallel().unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(rows))
        for request, matcher in zip((requests[i] for i in rows), matchers):
            if matcher.is_error():
                raise GrammarError(f"request {request.request_id}: {_short(matcher.get_error())}")
        everything = len(rows) == logits.shape[0] and logits.is_contiguous()
        masked = logits if everything else logits[rows]  # [R, V]
        _write_masks(masked, bits)
        if not everything:
            logits[rows] = masked
        return logits

    def mask_drafts(self, rows: torch.Tensor, requests: Sequence, drafts: Sequence[Sequence[int]]) -> None:
        """rows: [sum(n_b + 1), V] logits of drafting sequences, sequence after sequence, in place: a constrained
        sequence's row j masked as its grammar stands after its first j drafts. Its drafts are tried on the matcher
        and rolled back: from the first draft the grammar refuses on, the rows keep that position's mask (the
        refused draft is rejected there, and verification stops at it)."""
        start = 0
        for request, tokens in zip(requests, drafts):
            count = len(tokens) + 1
            matcher = request.matcher
            if matcher is not None:
                valid = matcher.validate_tokens(list(tokens))
                # an end token is not consumed: a grammar that stopped keeps no history of it (nothing follows one)
                valid = next((j for j, token in enumerate(tokens[:valid]) if token in self._eos_set), valid)
                bits, words = self._bitmasks(count)
                for j in range(valid + 1):
                    matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), words * 4)
                    if j < valid and not matcher.consume_token(tokens[j]):
                        raise GrammarError(f"request {request.request_id}: {_short(matcher.get_error())}")
                matcher.rollback(valid)
                if matcher.is_error():
                    raise GrammarError(f"request {request.request_id}: {_short(matcher.get_error())}")
                bits[valid + 1 :] = bits[valid]
                _write_masks(rows[start : start + count], bits)
            start += count

    def _bitmasks(self, count: int) -> tuple[torch.Tensor, int]:
        """``count`` empty bitmasks [count, words] (one bit per token of the vocabulary) and ``words``."""
        words = (self.vocab_size + 31) // 32
        return torch.zeros(count, words, dtype=torch.int32), words

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = _llg_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
        return self._tokenizer

    def _parallel(self):
        if self._executor is None:
            import llguidance

            from app.cpu.threads import spawning_unbound

            with spawning_unbound():  # its worker threads: every CPU, not the engine thread's bound one
                self._executor = llguidance.LLExecutor()
        return self._executor


def _llg_tokenizer(hf_tokenizer, vocab_size: int, eos: list[int] | None):
    """llguidance's tokenizer for ``hf_tokenizer``, built once per process for each vocabulary size and EOS set."""
    import llguidance.hf

    key = (vocab_size, tuple(eos or ()))
    try:
        built = _LLG_TOKENIZERS.setdefault(hf_tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: built for this engine alone
        built = {}
    if key not in built:
        try:
            built[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast tokenizers only
            raise GrammarError(f"structured outputs need a fast tokenizer for this model: {exc}") from exc
    return built[key]


def _write_masks(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """logits [R, V] (contiguous, float32), in place: -inf wherever ``bits`` [R, ceil(V / 32)] has a 0 bit."""
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, count=logits.shape[-1], bitorder="little")
    # [R, V]: all bits set where allowed, 0 where not; on the logits' device (llguidance writes host memory)
    keep = torch.from_numpy(allowed).to(device=logits.device, dtype=torch.int32).neg_()
    logits.view(torch.int32).bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS))


def consume(request, token_id: int) -> None:
    """Advance a constrained request's matcher by the token it emitted (the mask allowed it)."""
    if request.matcher is not None and not request.matcher.consume_token(token_id):
        raise GrammarError(f"token {token_id} does not continue the grammar: {_short(request.matcher.get_error())}")
