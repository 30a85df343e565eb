"""Logprobs in OpenAI's two formats: chat (``{"content": [{token, logprob, bytes, top_logprobs}]}``) and legacy
completions (parallel lists of tokens, logprobs, alternatives and text offsets; with echo, the prompt's tokens
first, the first one's logprob and alternatives null, as OpenAI and vLLM return them)."""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

from app.engine.request import TokenLogprob

logger = logging.getLogger(__name__)


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_tokenizer = None  # built on first need: ~0.5 s for a 49k vocabulary
        self._anchor: tuple[list[int], str] | None | bool = False  # probed on first need (False: not yet)

    def token_text(self, token_id: int) -> str:
        """The token's text as it reads inside a text: a sentencepiece decoder strips a word-initial token's space when
        it comes first (``▁world`` alone decodes to "world"), so such a token is decoded after an anchor token and
        the anchor's text taken off (" world", as OpenAI's and vLLM's token strings read)."""
        if self._anchor is False:
            self._anchor = _space_anchor(self.tokenizer)
        if self._anchor is None:
            return self.tokenizer.decode([token_id])
        anchor_ids, anchor_text = self._anchor
        text = self.tokenizer.decode([*anchor_ids, token_id])
        return text[len(anchor_text):] if text.startswith(anchor_text) else self.tokenizer.decode([token_id])

    def token_name(self, token_id: int, as_id: bool = False) -> str:
        """How a token is named in logprobs: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids: a name
        that identifies a token whose text does not, a partial character or one of several spellings)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own UTF-8 bytes, as OpenAI's ``bytes`` gives them: a token holding part of a character
        decodes to U+FFFD on its own, so its bytes come from the vocabulary itself (llguidance's reading of it)."""
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        if self._byte_tokenizer is None:
            self._byte_tokenizer = _byte_tokenizer(self.tokenizer)
        if not self._byte_tokenizer:  # a vocabulary llguidance cannot read: the text's bytes, as vLLM gives them
            return list(text.encode("utf-8"))
        return list(self._byte_tokenizer.decode_bytes([token_id]))

    def chat(self, logprobs: list[TokenLogprob] | None, as_ids: bool = False) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": f"token_id:{token_id}" if as_ids else text, "logprob": logprob,
                    "bytes": self.token_bytes(token_id, text)}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}

    def completion(self, logprobs: list[TokenLogprob] | None, prompt_ids: Sequence[int] | None = None,
                   prompt_logprobs: list[TokenLogprob | None] | None = None, text_offset: int = 0,
                   width: int | None = None, as_ids: bool = False) -> dict | None:
        """``prompt_logprobs`` (echo): one per prompt token, the first None, each with ``width`` alternatives at most,
        as the answer's tokens (prompt_logprobs may have asked for more). ``text_offset``: the first token's (a
        stream's chunk continues where the one before ended: ``next_text_offset``). Each token's alternatives include
        the token itself, as OpenAI returns them (up to logprobs + 1 entries). ``as_ids``: tokens named by id."""
        if logprobs is None:
            return None
        entries: list[tuple[int, float | None, list | None]] = []
        if prompt_ids and prompt_logprobs is not None:
            entries.append((prompt_ids[0], None, None))
            entries.extend((lp.token_id, lp.logprob, lp.top[:width]) for lp in prompt_logprobs[1:])
        entries.extend((lp.token_id, lp.logprob, lp.top) for lp in logprobs)
        # with ``as_ids`` the offsets count the names' characters, as vLLM's do (a stream's chunks then still agree)
        names = [self.token_name(token, as_ids) for token, _, _ in entries]
        if prompt_ids and prompt_logprobs is not None and not as_ids:  # the echoed text starts with it: as it reads there
            names[0] = self.tokenizer.decode([prompt_ids[0]])
        return {
            "tokens": names,
            "token_logprobs": [value for _, value, _ in entries],
            "top_logprobs": [None if top is None else {**{self.token_name(t, as_ids): v for t, v in top}, name: value}
                             for name, (_, value, top) in zip(names, entries)],
            "text_offset": list(itertools.accumulate((len(t) for t in names[:-1]), initial=text_offset))[:len(names)],
        }

    def vllm_prompt(self, prompt_logprobs: list[TokenLogprob | None], count: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (the first None), its id -> ``{logprob, rank, decoded_token}``,
        the token itself first, then its ``count`` likeliest alternatives (ranks 1..count). -inf is -9999.0, as vLLM
        writes it (JSON has no infinity)."""
        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": self.token_text(token_id)}

        answer: list[dict | None] = [None]
        for lp in prompt_logprobs[1:]:
            tokens = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (token_id, value) in enumerate(lp.top[:count], start=1):
                tokens.setdefault(str(token_id), entry(token_id, value, rank))
            answer.append(tokens)
        return answer


def next_text_offset(logprobs: dict | None, text_offset: int) -> int:
    """Where the token after a completions ``logprobs`` block starts (unchanged when it holds no token)."""
    if not logprobs or not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _space_anchor(tokenizer) -> tuple[list[int], str] | None:
    """(ids, text) of a short word, where the tokenizer's decoder strips the leading space of a text's first token;
    else None (a byte-level vocabulary: every token decodes alone as it reads in a text)."""
    try:
        ids = list(tokenizer.encode("a", add_special_tokens=False))
        alone = tokenizer.decode(ids) if ids else ""
        return (ids, alone) if alone and tokenizer.decode(ids * 2) != alone * 2 else None
    except Exception:  # noqa: BLE001 - a tokenizer this probe cannot run: tokens decoded alone
        return None


def _byte_tokenizer(tokenizer):
    """llguidance's view of the vocabulary (each token's bytes), or False where it cannot read this tokenizer."""
    try:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer)
    except Exception:  # noqa: BLE001 - any tokenizer it cannot read: fall back to the text's bytes
        logger.warning("token bytes of partial characters unavailable for this tokenizer", exc_info=True)
        return False
