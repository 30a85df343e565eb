"""Grammars compiled on a deep stack (structured outputs: app/api/structured.py at the API, app/engine/grammar.py in the
engine). Standard library only: the API's processes load it without torch."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

# llguidance's grammar compiler recurses once per link of a schema's $ref chain or a grammar's chain of rules (~8 KB
# of stack each): on a thread's default 8 MB a chain of ~1,000 links overflowed it and killed the process. Compiled on
# a stack this large (virtual: pages are committed as used), its own size limits refuse a schema first.
_COMPILE_STACK_BYTES = 1 << 30
_T = TypeVar("_T")


def on_a_deep_stack(compile_: Callable[[], _T]) -> _T:
    """``compile_()`` on a thread of its own with a ``_COMPILE_STACK_BYTES`` stack: its result, or its exception."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = compile_()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    previous = threading.stack_size(_COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=run, name="grammar-compile")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
