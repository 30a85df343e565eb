"""What a request of the async front can end with, beside its outputs: each maps to an HTTP status
(app/api/errors.py)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full; the caller should retry later (HTTP 503)."""


class ReplicaDrainingError(EngineOverloadedError):
    """This replica is shutting down and admits nothing new: another replica of the model can take the request."""


class EngineQueueTimeoutError(EngineOverloadedError):
    """A request had no first token within ``max_queue_time_s``; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped after an unrecoverable error; the replica must be replaced."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (the others went on)."""


class GrammarFailedError(RequestFailedError):
    """This request's grammar cannot be followed with the model's vocabulary (found by the engine's matcher: a token
    the grammar needs that the vocabulary cannot give, a schema that never ends): the request's to change."""

    @property
    def reason(self) -> str:
        """llguidance's words, without the engine's prefixes (the exception's class, the request id)."""
        text = str(self).removeprefix("GrammarError: ")
        return text.split(": ", 1)[1] if text.startswith("request ") and ": " in text else text


class NoTokenLeftFailedError(RequestFailedError):
    """Every token was banned at some step of this request (its allowed_token_ids, bad_words, min_tokens' stop tokens
    and format together): the request's to change."""

    @property
    def reason(self) -> str:
        """The sampler's words, without the engine's prefixes (the exception's class, the request id)."""
        text = str(self).removeprefix("NoTokenLeftError: ")
        return text.split(": ", 1)[1] if text.startswith("request ") and ": " in text else text


_FAILURES = {"GrammarError: ": GrammarFailedError, "NoTokenLeftError: ": NoTokenLeftFailedError}  # the request's own


def engine_failure(error: str | None, phase_times: dict[str, float] | None = None) -> RequestFailedError:
    """The engine's text for a failed request, as the exception its caller maps to a status; it carries the
    request's queue/prefill/decode times for the metrics."""
    text = error or "request failed in the engine"
    kind = next((kind for prefix, kind in _FAILURES.items() if text.startswith(prefix)), RequestFailedError)
    failure = kind(text)
    failure.phase_times = phase_times or {}
    return failure


class EngineShutdownError(RuntimeError):
    """The replica shut down before this request finished (its drain window ran out); the caller may retry."""
