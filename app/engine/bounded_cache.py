"""A least-recently-used cache bounded by entries and by size (grammars, kept by their text: app/api/structured.py at
the API, app/engine/grammar.py in the engine). Standard library only."""

from __future__ import annotations

import collections
from typing import Any, Hashable


class BoundedCache:
    """At most ``entries`` items, of at most ``size`` units (characters of text) in all: 256 grammars of up to 4 MB of
    schema each would otherwise keep gigabytes. An item larger than ``size`` alone is not kept."""

    def __init__(self, entries: int, size: int) -> None:
        self.entries, self.size = entries, size
        self._items: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._held = 0

    def get(self, key: Hashable) -> Any | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, value: Any, size: int) -> None:
        if key in self._items:
            self._held -= self._items.pop(key)[1]
        if size > self.size:
            return
        self._items[key] = (value, size)
        self._held += size
        while len(self._items) > self.entries or self._held > self.size:
            self._held -= self._items.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._items)
