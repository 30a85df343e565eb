"""The ingress's calls to a model deployment: a replica that Serve is stopping refuses before any output, and the
call goes to another replica; any other failure, or one after output, reaches the caller as it came; a stream the
ingress's own drain cuts ends with an error, never as if complete."""

import pytest

from app.engine.errors import EngineOverloadedError, EngineShutdownError, ReplicaDrainingError


class _WrappedByRay(RuntimeError):
    """What a handle raises for a replica's exception: Ray's RayTaskError keeps the original in ``.cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Answers:
    """A handle method's responses, one per call: each a list of chunks, then an exception to raise (or None)."""

    def __init__(self, handle, answers):
        self._handle, self._answers = handle, list(answers)

    def remote(self, request):
        self._handle.calls += 1
        chunks, error = self._answers.pop(0)
        return _Response(chunks, error)


class _Response:
    def __init__(self, chunks, error):
        self._chunks, self._error, self.cancelled = list(chunks), error, False

    def cancel(self):
        self.cancelled = True

    def __await__(self):
        async def answer():
            if self._error is not None:
                raise self._error
            return self._chunks[0]
        return answer().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._chunks:
            return self._chunks.pop(0)
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration


class _Handle:
    def __init__(self, answers):
        self.calls = 0
        self.completion = self.completion_stream = _Answers(self, answers)

    def options(self, **_):
        return self


def _draining():
    return _WrappedByRay(ReplicaDrainingError("the replica is shutting down; retry on another replica"))


@pytest.fixture(autouse=True)
def no_waits(monkeypatch):
    from deployments import routes

    monkeypatch.setattr(routes, "DRAINING_RETRY_DELAYS_S", (0, 0, 0), raising=False)


async def _streamed(handle):
    from deployments.routes import RemoteModel

    return [chunk async for chunk in RemoteModel(handle).stream("completion", object())]


async def test_a_stream_refused_by_a_draining_replica_goes_to_another():
    handle = _Handle([([], _draining()), ([], _draining()), (["a", "b"], None)])
    assert await _streamed(handle) == ["a", "b"]
    assert handle.calls == 3


async def test_a_call_refused_by_a_draining_replica_goes_to_another():
    from deployments.routes import RemoteModel

    handle = _Handle([([], _draining()), (["answer"], None)])
    assert await RemoteModel(handle).call("completion", object()) == "answer"
    assert handle.calls == 2


async def test_refusals_past_the_last_try_reach_the_caller():
    handle = _Handle([([], _draining())] * 4)  # a first try and one for each of the three waits
    with pytest.raises(_WrappedByRay):
        await _streamed(handle)
    assert handle.calls == 4


@pytest.mark.parametrize("answers", [
    [(["a"], _draining())],  # after output: the client has part of its answer, a second one would repeat it
    [([], _WrappedByRay(EngineOverloadedError("the replica already holds 64 requests")))],  # full: backpressure's 503
])
async def test_other_failures_and_failures_after_output_are_not_retried(answers):
    handle = _Handle(answers)
    with pytest.raises(_WrappedByRay):
        await _streamed(handle)
    assert handle.calls == 1


async def test_a_stream_cut_at_the_drains_deadline_ends_with_an_error_even_where_the_handle_stream_ends_quietly():
    """A cancelled handle stream can end without an exception (Ray's streaming generator, cancelled while its replica
    ends it): the client must still learn that its answer was cut."""
    from deployments.routes import Relayed, RemoteModel

    relayed = Relayed()
    stream = RemoteModel(_Handle([(["a", "b"], None)]), relayed).stream("completion", object())
    assert await stream.__anext__() == "a"
    assert relayed.cut_all() == 1  # the ingress's drain window is over
    assert await stream.__anext__() == "b"  # already on its way
    with pytest.raises(EngineShutdownError, match="shut down before this request finished"):
        await stream.__anext__()
    assert len(relayed) == 0 and not relayed.was_cut(object())


async def test_a_stream_that_ends_before_the_cut_is_complete():
    from deployments.routes import Relayed, RemoteModel

    relayed = Relayed()
    assert [c async for c in RemoteModel(_Handle([(["a", "b"], None)]), relayed).stream("completion", object())] == ["a", "b"]
    assert relayed.cut_all() == 0
