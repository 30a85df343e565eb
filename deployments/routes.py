"""How the ingress reaches a model: in its own process, or through the model deployment's handle.

Both kinds answer the same calls (``call``, ``stream``, ``model_card``, ``stats``), so the ingress
routes by model name without caring where the model runs. A streamed chunk that crosses a handle
costs a Ray message each way (~1 ms of CPU on a 2-core EPYC, more than the proxy's hop); a model
the ingress hosts itself streams to the HTTP response with no hop at all.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle

from app.api.errors import caused_by
from app.engine.errors import EngineShutdownError, ReplicaDrainingError
from deployments.admission import HostedModel

# A model replica that Serve is stopping refuses new requests once its drain begins (deployments/lifecycle.py); a
# router that has not yet heard of the stop can still pick it. Such a refusal comes before any output, so the call
# goes again, and the router, updated meanwhile, picks another replica: waits before each try, ~3 s in all.
DRAINING_RETRY_DELAYS_S = (0.1, 0.4, 1.0, 1.5)


class Relayed:
    """The calls this replica has in flight at other deployments, so that a draining replica can end those
    still running at its deadline with an explicit error (deployments/lifecycle.py) instead of being killed
    under them."""

    def __init__(self) -> None:
        self._responses: set = set()
        self._cut_in_flight: set = set()  # the responses cut_all cancelled
        self.cut = False

    def __len__(self) -> int:
        return len(self._responses)

    @contextlib.contextmanager
    def tracking(self, response):
        self._responses.add(response)
        try:
            yield
        except Exception:
            if self.cut:  # cancelled by cut_all: the caller reads why
                raise EngineShutdownError("the replica shut down before this request finished") from None
            raise
        finally:
            self._responses.discard(response)
            self._cut_in_flight.discard(response)

    def cut_all(self) -> int:
        self.cut = True
        responses = list(self._responses)
        for response in responses:
            response.cancel()
        self._cut_in_flight.update(responses)
        return len(responses)

    def was_cut(self, response) -> bool:
        return response in self._cut_in_flight


class RemoteModel:
    """A model served by its own deployment (scaled on its own), reached through its handle."""

    def __init__(self, handle: DeploymentHandle, relayed: Relayed | None = None) -> None:
        self.handle = handle
        self.relayed = relayed if relayed is not None else Relayed()
        self._cards: dict[str, dict] = {}  # a card is the model's (name, source, context): asked for once

    async def call(self, kind: str, request) -> dict:
        for delay_s in (*DRAINING_RETRY_DELAYS_S, None):
            response = getattr(self.handle, kind).remote(request)
            try:
                with self.relayed.tracking(response):
                    return await response
            except Exception as exc:
                if delay_s is None or not caused_by(exc, ReplicaDrainingError):
                    raise
            await asyncio.sleep(delay_s)

    async def stream(self, kind: str, request) -> AsyncIterator[dict]:
        for delay_s in (*DRAINING_RETRY_DELAYS_S, None):
            responses = getattr(self.handle.options(stream=True), f"{kind}_stream").remote(request)
            streamed = finished = False
            try:
                with self.relayed.tracking(responses):
                    async for chunk in responses:
                        streamed = True
                        yield chunk
                    if self.relayed.was_cut(responses):
                        # a handle stream cancelled mid-answer can end as a complete one would: say it was cut
                        raise EngineShutdownError("the replica shut down before this request finished")
                finished = True
                return
            except Exception as exc:
                if streamed or delay_s is None or not caused_by(exc, ReplicaDrainingError):
                    raise
            finally:
                if not finished:  # the client went away: stop generating for it
                    responses.cancel()
            await asyncio.sleep(delay_s)

    async def model_card(self, name: str) -> dict:
        if name not in self._cards:
            self._cards[name] = await self.handle.model_card.remote(name)
        return self._cards[name]

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    async def metrics(self) -> dict[str, dict]:
        return await self.handle.metrics.remote()


class LocalModel:
    """The model this ingress replica hosts itself: requests and their chunks stay in the process.

    Leaving the stream early (a client disconnect) closes the serving generator, which aborts the
    request in the engine, as a cancelled handle stream does for a remote model.
    """

    def __init__(self, hosted: HostedModel) -> None:
        self.hosted = hosted

    async def call(self, kind: str, request) -> dict:
        return await getattr(self.hosted.server.serving, kind)(request)

    def stream(self, kind: str, request) -> AsyncIterator[dict]:
        return getattr(self.hosted.server.serving, f"{kind}_stream")(request)

    async def model_card(self, name: str) -> dict:
        return self.hosted.server.model_card(name)

    async def stats(self) -> dict:
        return self.hosted.stats()

    async def metrics(self) -> dict[str, dict]:
        return self.hosted.server.metrics()
