"""What clients read about failures: their own mistakes as they are, ours as plain words plus a request id.

Ray's exception classes are the real ones (imported, no cluster started): app/ knows them by name only.
"""

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError

from app.api.errors import APIError, to_api_error
from app.engine import EngineDeadError, EngineOverloadedError, RequestFailedError

SECRET = "secret internal detail"


def _from_replica(exc: BaseException) -> BaseException:
    """``exc`` as a caller of the replica that raised it receives it: wrapped by Ray, traceback and all."""
    return RayTaskError("LLMServer.completion", f"Traceback ...\n{type(exc).__name__}: {exc}", exc).as_instanceof_cause()


def _assert_plain(error: APIError) -> None:
    for internal in (SECRET, "Error", "Traceback"):
        assert internal not in error.message, error.message


@pytest.mark.parametrize("exc, status, code", [
    (RuntimeError(SECRET), 500, "internal_error"),
    (_from_replica(RuntimeError(SECRET)), 500, "internal_error"),
    (_from_replica(KeyError(SECRET)), 500, "internal_error"),
    (ValueError(SECRET), 500, "internal_error"),  # a ValueError deep inside is our bug, not the client's
    (_from_replica(RequestFailedError(f"RuntimeError: {SECRET}")), 500, "generation_failed"),
    (_from_replica(EngineDeadError(f"engine stopped: EOFError: {SECRET}")), 503, "replica_unavailable"),
    (ActorDiedError(), 503, "replica_unavailable"),
    (ActorUnavailableError(SECRET, None), 503, "replica_unavailable"),
    (WorkerCrashedError(), 503, "replica_unavailable"),
    (BackPressureError(num_queued_requests=9, max_queued_requests=8), 503, "overloaded"),
], ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None)
def test_server_failures_are_plain_words_with_the_request_id(exc, status, code):
    error = to_api_error(exc, "req-123")
    assert (error.status, error.code) == (status, code)
    assert error.message.endswith(" (request id req-123)")
    _assert_plain(error)
    assert error.to_dict()["error"]["message"] == error.message


def test_a_dead_replica_says_to_retry():
    assert to_api_error(ActorDiedError(), "r1").message == "the model replica stopped while serving this request; retry (request id r1)"


def test_overload_keeps_its_own_message_written_for_clients():
    error = to_api_error(_from_replica(EngineOverloadedError("the replica already holds 8 requests; retry later")), "r2")
    assert (error.status, error.code) == (503, "overloaded")
    assert error.message == "the replica already holds 8 requests; retry later (request id r2)"


def test_client_errors_pass_unchanged_even_through_ray():
    original = APIError(404, "The model 'x' does not exist", param="model", code="model_not_found")
    for exc in (original, _from_replica(original)):
        error = to_api_error(exc, "r3")
        assert (error.status, error.message, error.param, error.code) == (404, original.message, "model", "model_not_found")
        assert error.type == "invalid_request_error"  # as OpenAI types an unknown model


def test_without_a_request_id_the_message_is_the_plain_words_alone():
    assert to_api_error(RuntimeError(SECRET)).message == "internal error while serving this request; the server log has the details"


def test_a_grammar_the_vocabulary_cannot_follow_is_the_clients_400_in_llguidances_words():
    from app.engine.errors import engine_failure as _failure

    failure = _failure("GrammarError: request cmpl-1: token 2 does not continue the grammar: forced bytes: got '<'")
    for exc in (failure, _from_replica(failure)):
        error = to_api_error(exc, "r9")
        assert (error.status, error.code) == (400, "invalid_grammar")
        assert error.message.endswith("vocabulary: token 2 does not continue the grammar: forced bytes: got '<'")
    assert to_api_error(_failure("RuntimeError: boom"), "r9").status == 500  # any other failure stays ours
