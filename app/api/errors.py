"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from app.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error a client caused or can act on; carries its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def __reduce__(self):  # keeps the fields when Ray pickles the exception between replicas
        return (APIError, (self.status, self.message, self.param, self.code))

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception (also one wrapped by Ray on its way between replicas) to an APIError."""
    for _ in range(5):  # Ray's RayTaskError keeps the original exception in .cause
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the model replica is unavailable ({exc}); it is being replaced, retry shortly")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"generation failed: {exc}", code="generation_failed")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")
