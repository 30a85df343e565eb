"""The inference engine: requests, sampling, batching modes and the async front."""

from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, EngineShutdownError, RequestFailedError
from app.engine.engine import LLMEngine
from app.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from app.models import LoadedModel


def build_engine_core(loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
    """The engine core (driven by AsyncEngine); ``config.batching`` picks the scheduling policy."""
    return LLMEngine(loaded, config)


__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineShutdownError",
    "LLMEngine",
    "Request",
    "RequestFailedError",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "build_engine_core",
]
