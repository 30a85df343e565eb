"""How a request's stream paces its chunks: ``stream_interval_ms`` and ``max_stream_chunks_per_s``.

Unpaced (both 0, the default), every token goes out as a chunk of its own as it comes. Paced, a stream pauses after
each chunk while other requests run, and the tokens that gathered meanwhile go out as one chunk: each chunk costs
CPU on every hop of the streaming path (replica, ingress, proxy; ~4 ms in all on a 2-core AVX2 EPYC), CPU the engine
shares on small machines.
"""

from __future__ import annotations

import asyncio

from app.engine.request import RequestOutput


class StreamPacing:
    def __init__(self, stream_interval_s: float = 0.0, max_chunks_per_s: float = 0.0):
        self.stream_interval_s = stream_interval_s
        self.max_chunks_per_s = max_chunks_per_s

    @property
    def paced(self) -> bool:
        return self.stream_interval_s > 0 or self.max_chunks_per_s > 0

    def pause_s(self, running: int) -> float:
        """How long a stream lets tokens gather after sending a chunk while ``running`` requests run (0 for a lone
        request). ``max_chunks_per_s`` caps all streams together, so the pause grows with the number of running
        requests; ``stream_interval_s`` is a floor per stream."""
        if running <= 1:
            return 0.0
        by_rate = running / self.max_chunks_per_s if self.max_chunks_per_s else 0.0
        return max(self.stream_interval_s, by_rate)


def merge_ready(first, pending: asyncio.Queue) -> tuple[RequestOutput | BaseException, BaseException | None]:
    """Fold outputs that queued up behind ``first`` into one delta; returns it and any failure read after it
    (an exception, or an output that ends the request with an error), which the caller takes next.

    Only for paced streams: the tokens that gathered during a pause go out as one chunk.
    """
    merged = first
    while isinstance(merged, RequestOutput) and not merged.finished and not pending.empty():
        nxt = pending.get_nowait()
        if not isinstance(nxt, RequestOutput) or nxt.finish_reason == "error":
            return merged, nxt  # the tokens before a failure go out first; the failure ends the stream next
        merged = merged.followed_by(nxt)
    return merged, None
