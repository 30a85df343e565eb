"""Incremental detokenization with stop strings.

Decoding only a short window of tokens per step keeps the cost constant per token; a window that
ends inside a multi-byte character (decodes to U+FFFD) waits for the next token. Text that might be
the start of a stop string is held back until it is known not to be, so a streamed response never
shows a stop string that the final text would not contain.
"""

from __future__ import annotations

from typing import Sequence

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for the leading space
# A window still unfinished after this many new tokens never will be (a character is at most 4 bytes): it goes out as
# it decodes (U+FFFD for bytes that are no character). Held longer, it would grow with every token, and so would the
# cost of decoding it (a model biased to a lone continuation byte: 1.4 ms a token at 4,000 tokens).
_MAX_PENDING_TOKENS = 6


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids ``skip_special_tokens`` decodes to nothing: the special ones among the added tokens too."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", ())) | frozenset(
        i for i, token in added.items() if getattr(token, "special", False))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        special_ids: frozenset[int] | None = None,
    ) -> None:
        """``include_stop``: the text ends after the stop string that ended it, not before (vLLM's
        include_stop_str_in_output). ``special_ids``: the tokenizer's ``special_token_ids`` (found here if not given)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # skipped tokens add no text: kept out of the window, they neither count as a character still pending nor,
        # at its start, take the place of the token whose leading space the decoder would then strip
        self._skipped = frozenset() if not skip_special_tokens else special_ids if special_ids is not None else \
            special_token_ids(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far, cut at a stop string if one was hit
        self._emitted = 0  # characters of self.text already handed out
        self.stopped_by: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Add one token; return (text now safe to emit, whether a stop string was hit)."""
        if token_id in self._skipped:
            return "", False
        self._ids.append(token_id)
        new = self._decode_new()
        if not new:
            return "", False
        new_from = len(self.text)
        self.text += new
        if check_stop:
            cut = self._find_stop(new_from)
            if cut is not None:
                self.text = self.text[:cut]
                return self.flush(), True
        # Text that may begin a stop string waits until it is known not to; with the stop string kept in the output,
        # nothing before one's end can be cut, so nothing waits (as vLLM).
        safe_end = len(self.text) - (0 if self._include_stop else self._holdback)
        return self._emit_until(safe_end), False

    def flush(self) -> str:
        """All text not yet emitted (the request is finishing)."""
        return self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self, new_from: int) -> int | None:
        """Where the text ends: at the stop string completed first among those that end in the text from ``new_from``
        on (after it, with ``include_stop``), else None: as vLLM searches, each stop string back by its own length (one
        ending before was in text already checked, or in text min_tokens kept from stopping), and as a stream read
        character by character would stop."""
        starts = ((s, max(0, new_from - len(s) + 1)) for s in self._stop)
        hits = [(i + len(s), i) for i, s in ((self.text.find(s, start), s) for s, start in starts) if i != -1]
        if not hits:
            return None
        end, begin = min(hits)
        self.stopped_by = self.text[begin:end]  # the stop string that ended it (vLLM's stop_reason)
        return end if self._include_stop else begin

    def _decode_new(self) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        waiting = len(full) <= len(prefix) or full.endswith("\ufffd")  # nothing new yet, or an incomplete UTF-8 sequence
        if waiting and len(self._ids) - self._read_offset < _MAX_PENDING_TOKENS:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]
