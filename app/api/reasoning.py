"""A reasoning model's thinking apart from its answer (``model.reasoning_parser``, as vLLM's ``--reasoning-parser``):
text between ``<think>`` and ``</think>`` is the message's ``reasoning`` (vLLM's field; also ``reasoning_content``,
the DeepSeek API's and older vLLM's name, which LiteLLM and Open WebUI read), the rest its ``content``.

The answer starts inside the reasoning when the prompt leaves a ``<think>`` open (DeepSeek-R1's template, Qwen3's
thinking templates) or when the answer opens one, and, for ``deepseek_r1`` (as vLLM reads R1), when the prompt holds
no block at all; otherwise (Qwen3 with ``enable_thinking: false``, whose template writes an empty block) it is all
content (``starts_inside``). An answer cut short inside its reasoning has no content. A response format's or forced
call's grammar holds the answer after the thinking (``after_thinking``), as vLLM starts it after the reasoning ends."""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, Callable

from app.api.structured import special_token, token_or_text


OPEN, CLOSE = "<think>", "</think>"
CALL_MARKER = "<tool_call>"  # Hermes' and Qwen3-Coder's calls open with it


def starts_inside(parser: str, tail: str, continued: bool = False) -> bool:
    """Whether the answer starts thinking, from what the template writes after the last message (its opening of the
    assistant's turn) or, ``continued``, the assistant message the answer continues: where that leaves a think block
    open (its last ``<think>`` after its last ``</think>``: DeepSeek-R1's template, Qwen3's thinking templates, a
    message continued from inside one); for ``deepseek_r1`` also where a turn it opens holds no block at all, as vLLM
    reads R1 (its answer thinks first, until ``</think>``), but not where it closes one (thinking turned off)."""
    opened, closed = tail.rfind(OPEN), tail.rfind(CLOSE)
    if opened > closed:
        return True
    return parser == "deepseek_r1" and not continued and opened == closed == -1


def answer_starts_inside(parser: str | None, request, turn_opening: Callable[[], str]) -> bool | None:
    """Whether a chat answer starts thinking (``starts_inside``), or None where it is not split (no parser). What the
    answer follows: the assistant message it continues (``continue_final_message``), else ``turn_opening()``, what the
    template writes after the last message to open the answer's turn (the user's own words, which may hold the
    markers or be found inside them, left out)."""
    if parser is None:
        return None
    tail = request.messages[-1].text() if request.continue_final_message else turn_opening()
    return starts_inside(parser, tail, request.continue_final_message)


def call_ends_thinking(parser: str | None, tool_parser: str, request, plan) -> str | None:
    """Qwen3's call marker, where a call written while thinking ends the thinking (vLLM's qwen3 parser reads it so):
    calls read from the free text (``auto``, no grammar holding the answer), in a format that opens with the marker."""
    if parser != "qwen3" or plan.reasoning_inside is None or request.tool_choice_resolved() != "auto":
        return None
    return CALL_MARKER if plan.sampling.grammar is None and tool_parser in ("hermes", "qwen3_coder") else None


def after_thinking(grammar: str, tokenizer, inside: bool) -> str:
    """``grammar`` (llguidance's: its JSON form, or Lark's text) holding the answer after its thinking: free text up to
    ``</think>`` (where the answer does not start inside, either a ``<think>`` block first or no thinking at all),
    whitespace, then what ``grammar`` allows. A marker that is one token the tokenizer added (Qwen3's, DeepSeek-R1's) is that token
    (llguidance reads every added token as special, never as text); any other is its text, the thinking ending at
    its first occurrence."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}  # or Lark
    first, *rest = top["grammars"]
    opening, closing = token_or_text(tokenizer, OPEN), token_or_text(tokenizer, CLOSE)
    if closing.startswith("<["):
        thinking = f"thinking: TEXT {closing}\nTEXT: /(?s:.*)/\n"
    else:  # lazy: the thinking ends at the first </think>
        thinking = f"thinking[lazy]: TEXT {closing}\nTEXT: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n"
    head = f"(WS? {opening})? thinking" if inside else f"(WS? {opening} thinking)?"  # inside: it may open it again
    lark = f"%llguidance {{}}\nstart: {head} WS? @answer_after_thinking\nWS: /[ \\t\\r\\n]+/\n{thinking}"
    grammars = [{"name": "thinking_then_answer", "lark_grammar": lark}, {**first, "name": "answer_after_thinking"}, *rest]
    return json.dumps({**top, "grammars": grammars})


def reasoned_message(text: str, inside: bool, shown: bool, build: Callable[[str], dict], ends_at: str | None = None) -> dict:
    """The message ``build`` makes of a whole answer's content, with its reasoning (where ``shown``) beside it."""
    thought, content = split(text, inside, ends_at)
    message = build(content or "")
    if content is None and message["content"] == "":
        message["content"] = None
    if thought is not None and shown:
        message["reasoning"] = message["reasoning_content"] = thought
    return message


def thinking_tokens(token_ids: list[int], inside: bool, tokenizer, ends_at: str | None = None) -> int:
    """How many of an answer's tokens are its thinking: up to and including ``</think>`` where that is one token, all of
    them where the thinking never ended, else as many as its reasoning's text encodes to; 0 for an answer that did not
    think."""
    thought, content = split(tokenizer.decode(token_ids), inside, ends_at)
    if thought is None:
        return 0
    close = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(close) == 1 and close[0] in token_ids and not _ended_by_call(content, ends_at):
        return token_ids.index(close[0]) + 1
    if content is None:
        return len(token_ids)
    return len(tokenizer.encode(thought, add_special_tokens=False))


def _ended_by_call(content: str | None, ends_at: str | None) -> bool:
    """Whether the thinking ended at a call's marker (its content starts with it), not at </think>."""
    return bool(ends_at) and content is not None and content.startswith(ends_at)


def usage_with_thinking(usage: dict, plans: list, tokenizer) -> dict:
    """A chat answer's usage with ``completion_tokens_details.reasoning_tokens`` (as OpenAI's and vLLM's with a
    reasoning parser) where its thinking is split."""
    if all(p.reasoning_inside is None for p in plans):
        return usage
    count = sum(thinking_tokens(p.token_ids, p.reasoning_inside, tokenizer, p.call_ends_thinking) for p in plans
                if p.reasoning_inside is not None and p.token_ids)
    return {**usage, "completion_tokens_details": {"reasoning_tokens": count}}


def is_special(tokenizer) -> bool:
    """Whether ``</think>`` is one token the tokenizer leaves out of text under ``skip_special_tokens``."""
    return special_token(tokenizer, CLOSE)


class ReasoningSplitter:
    """An answer's text, fed piece by piece, split into (reasoning, content) pieces; text that may be the start of a
    marker waits until it is known not to be one, so a stream never shows a marker's characters."""

    def __init__(self, inside: bool, ends_at: str | None = None) -> None:
        self.inside = inside
        self.ends_at = ends_at  # a marker that also ends the thinking, and stays in the content (Qwen3's <tool_call>)
        self.opening = True  # at the output's start: it may open a think block, or open it again (whitespace waits)
        self.done = False  # past </think>: the rest is content
        self.ended_by_call = False  # thinking ended at ends_at: the block's own </think>, if it comes, is left out (vLLM)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while True:
            if self.opening:
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._held, self.inside, self.opening = stripped[len(OPEN):], True, False
                    continue
                if not stripped or OPEN.startswith(stripped):
                    return reasoning, content  # whitespace, or the start of <think>: not known yet
                self.opening = False
            if self.inside and not self.done:
                end = self._held.find(CLOSE)
                call = self._held.find(self.ends_at) if self.ends_at else -1
                if call >= 0 and (end < 0 or call < end):  # a call while thinking: the thinking ended there
                    reasoning += self._held[:call]
                    self._held, self.done, self.ended_by_call = self._held[call:], True, True
                    continue
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held, self.done = self._held[end + len(CLOSE):], True
                    continue
                keep = max(_partial_marker(self._held, CLOSE), _partial_marker(self._held, self.ends_at or ""))
                reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return reasoning, content
            if self.ended_by_call:  # the </think> of the block the call ended is no content
                end = self._held.find(CLOSE)
                if end < 0:
                    keep = _partial_marker(self._held, CLOSE)
                    content += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return reasoning, content
                self._held, self.ended_by_call = self._held[:end] + self._held[end + len(CLOSE):], False
            content += self._held
            self._held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, at the answer's end: reasoning if inside an open block, else content."""
        held, self._held = self._held, ""
        return (held, "") if self.inside and not self.done else ("", held)


def split(text: str, inside: bool, ends_at: str | None = None) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), as its stream splits it: None where there is none (what follows
    </think> is the content as written, as vLLM gives it)."""
    splitter = ReasoningSplitter(inside, ends_at)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    if not splitter.inside:
        return None, content
    return reasoning, content or None


def _partial_marker(text: str, marker: str) -> int:
    """How many of ``text``'s last characters begin ``marker`` (they wait for what follows)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


async def reasoned_chunks(chunks: AsyncIterator[dict], inside: bool, shown: bool = True,
                          ends_at: str | None = None) -> AsyncIterator[dict]:
    """One choice's chat chunks with each delta's text split: its reasoning as ``reasoning`` (and
    ``reasoning_content``; none unless ``shown``), the rest as ``content``; every chunk still goes out (a token held
    back while it may begin a marker has an empty delta), the held text at the finish."""
    splitter = ReasoningSplitter(inside, ends_at)
    async with contextlib.aclosing(chunks):  # closed with this stream (a client gone): its request aborted at once
        async for chunk in chunks:
            choice = chunk["choices"][0]
            thought, content = splitter.feed(choice["delta"].get("content") or "")
            if choice["finish_reason"] is not None:
                more_thought, more_content = splitter.finish()
                thought, content = thought + more_thought, content + more_content
            thought = thought if shown else ""
            delta = {"reasoning": thought, "reasoning_content": thought} if thought else {}
            if content or (not thought and "content" in choice["delta"]):
                delta["content"] = content
            yield {**chunk, "choices": [{**choice, "delta": delta}]}
