"""A long text grown piece by piece where it is held (an attribute, a list or dict item), in amortized linear time.

CPython appends to a string in place only where nothing else refers to it. ``self.text += piece`` copies the whole
text for every piece, since the attribute still holds it: quadratic in a long streamed answer, on the event loop
every stream shares (docs/benchmark-log.md has the figures). These take the text out of its holder first, so that
the append resizes it in place.
"""

from __future__ import annotations

from typing import Any


def grow_attribute(holder: Any, name: str, piece: str) -> None:
    """``holder.<name> += piece``, in place."""
    text = holder.__dict__.pop(name)
    try:
        text += piece
    finally:  # a piece that is no text leaves the text as it was
        holder.__dict__[name] = text


def grow_item(container: Any, key: Any, piece: str) -> None:
    """``container[key] += piece``, in place."""
    text = container[key]
    container[key] = ""
    try:
        text += piece
    finally:
        container[key] = text
