"""The inference engine: requests, sampling, batching modes and the async front."""

from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestFailedError
from app.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from app.models import LoadedModel


def build_engine_core(loaded: LoadedModel, config: EngineConfig):
    """The engine core (driven by AsyncEngine) for ``config.batching`` on a loaded model."""
    if config.batching == "none":
        from app.engine.serial import SerialEngine

        return SerialEngine(loaded)
    # EngineConfig validated the mode, so reaching here is a missing branch, not bad input.
    raise NotImplementedError(f"batching mode {config.batching!r}")


__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "Request",
    "RequestFailedError",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "build_engine_core",
]
