"""Places held on a replica for the generations of one OpenAI request (``AsyncEngine.reserve``)."""

from __future__ import annotations


class Reservation:
    """Places held on the replica for the generations of one OpenAI request (``AsyncEngine.reserve``): each takes its
    own as it starts, and the request gives back what is left as it ends. Admitted whole or refused whole, also against
    requests arriving while its generations start (they start one by one, on later turns of the loop)."""

    def __init__(self, engine, count: int) -> None:
        self._engine, self._left = engine, count
        engine._reserved += count

    def take(self) -> None:
        if self._left > 0:
            self._left -= 1
            self._engine._reserved -= 1

    def release(self) -> None:
        self._engine._reserved -= self._left
        self._left = 0
