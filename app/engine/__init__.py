"""The inference engine: requests, sampling, batching modes and the async front.

The async front and the request types load without torch; ``LLMEngine`` and ``build_engine_core`` (the
model-running core: torch, transformers, the CPU kernels) load on first use, so a replica that only routes
or serves from an engine process starts without them.
"""

from app.engine.async_engine import AsyncEngine
from app.engine.errors import EngineDeadError, EngineOverloadedError, EngineShutdownError, RequestFailedError
from app.engine.request import Request, RequestOutput, RequestStatus, SamplingParams


def build_engine_core(loaded, config):
    """The engine core (driven by AsyncEngine); ``config.batching`` picks the scheduling policy."""
    from app.engine.engine import LLMEngine

    return LLMEngine(loaded, config)


def __getattr__(name: str):
    if name == "LLMEngine":
        from app.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
