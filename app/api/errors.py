"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from app.engine.errors import (EngineDeadError, EngineOverloadedError, EngineQueueTimeoutError, EngineShutdownError,
                               GrammarFailedError, NoTokenLeftFailedError, ReplicaDrainingError,
                               RequestFailedError)

# What json.loads raises on text it cannot read: not JSON (JSONDecodeError is a ValueError), nested past the parser's
# depth (RecursionError), an integer of 4,300+ digits (ValueError). A JSON string inside a body, or a model's output,
# can be any of these: each is an answer (a 400, or text that is no call), never a 500.
NOT_JSON = (ValueError, RecursionError)

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",  # as OpenAI types an unknown model (code model_not_found)
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
NO_TOKEN_LEFT = "no_token_left"  # the code of a request whose bans leave no token to choose, found up front or by the engine


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


# Ray's errors, known by class name (app/ never imports ray), anywhere in an error's class hierarchy.
_RAY_BUSY = frozenset({"BackPressureError", "DeploymentUnavailableError", "ReplicaUnavailableError", "ActorUnschedulableError"})
_RAY_GONE = frozenset({"RayActorError", "WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "OwnerDiedError"})

# What a client reads about a failure on our side: plain words and what to do, never the exception's
# class or text (they describe internals; the server log has them under the same request id).
_RETRY_BUSY = "the model server cannot take this request now; retry shortly"
_RETRY_GONE = "the model replica stopped while serving this request; retry"
_RETRY_ENGINE = "the model replica's engine stopped; it is being replaced, retry shortly"
_RETRY_SHUTDOWN = "the model replica shut down before this request finished; retry"
_GENERATION_FAILED = "generation failed for this request; the server log has the details"
_INTERNAL = "internal error while serving this request; the server log has the details"


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map any exception (also one wrapped by Ray on its way between replicas) to what the client sees.

    An APIError is already meant for the client and passes unchanged. Anything else is a failure on
    our side (5xx): its message is one of ours, followed by ``request_id`` for the log lookup.
    """
    chain = _cause_chain(exc)
    innermost = chain[-1]
    if isinstance(innermost, APIError):
        return innermost
    if isinstance(innermost, GrammarFailedError):  # the request's grammar, not our failure: llguidance's words
        return APIError(400, f"the output cannot follow this request's grammar with this model's vocabulary: "
                             f"{innermost.reason}", code="invalid_grammar")
    if isinstance(innermost, NoTokenLeftFailedError):
        return APIError(400, f"no token is left to choose: {innermost.reason}; allow more tokens", code=NO_TOKEN_LEFT)
    status, message, code = _server_failure(chain)
    return APIError(status, f"{message} (request id {request_id})" if request_id else message, code=code)


def client_error(exc: BaseException) -> "APIError | None":
    """The APIError ``exc`` is or wraps (as Ray does between replicas), which the client reads as it is; else None."""
    innermost = _cause_chain(exc)[-1]
    return innermost if isinstance(innermost, APIError) else None


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is, or wraps (as Ray does between replicas), an exception of type ``kind``."""
    return any(isinstance(link, kind) for link in _cause_chain(exc))


def _cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: Ray's RayTaskError keeps the original exception in ``.cause``."""
    chain = [exc]
    for _ in range(5):
        cause = getattr(chain[-1], "cause", None)
        if not isinstance(cause, BaseException):
            break
        chain.append(cause)
    return chain


def _server_failure(chain: list[BaseException]) -> tuple[int, str, str]:
    innermost = chain[-1]
    if isinstance(innermost, EngineQueueTimeoutError):  # our own words, written for clients
        return 503, str(innermost), "queue_timeout"
    if isinstance(innermost, EngineOverloadedError):  # our own words, written for clients
        return 503, str(innermost), "overloaded"
    class_names = {cls.__name__ for exc in chain for cls in type(exc).__mro__}
    if class_names & _RAY_BUSY:
        return 503, _RETRY_BUSY, "overloaded"
    if class_names & _RAY_GONE:
        return 503, _RETRY_GONE, "replica_unavailable"
    if isinstance(innermost, EngineDeadError):
        return 503, _RETRY_ENGINE, "replica_unavailable"
    if isinstance(innermost, EngineShutdownError):
        return 503, _RETRY_SHUTDOWN, "replica_unavailable"
    if isinstance(innermost, RequestFailedError):  # carries the engine's exception text: not for clients
        return 500, _GENERATION_FAILED, "generation_failed"
    return 500, _INTERNAL, "internal_error"


def rejection_reason(error: BaseException) -> str:
    """The metrics' ``reason`` label of a request refused before the engine took it."""
    if isinstance(error, ReplicaDrainingError):
        return "draining"
    return "stopped" if isinstance(error, EngineDeadError) else "overloaded"
