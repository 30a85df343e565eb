"""Draft calls sent from a target engine's front (app/engine/draft_calls.py): each one answered, whatever becomes of
it, and none carried in a client request's context."""

from __future__ import annotations

import asyncio
import contextvars

from app.config import AppConfig
from app.engine.draft_calls import DraftCallSender
from app.engine.request import Request, SamplingParams
from app.spec.remote import DraftCall, DraftResult
from tests.serve.fake_model import fake_model_server

REQUEST_ID = contextvars.ContextVar("request_id", default=None)  # stands for Serve's request context


async def test_a_cancelled_call_is_answered_so_its_sequence_asks_again():
    async def cancelled(call):
        future = asyncio.get_running_loop().create_future()
        future.cancel()  # what awaiting a handle call that Serve cancelled raises
        return await future

    posted = []
    sender = DraftCallSender(cancelled, posted.extend)
    sender.send([DraftCall(7, 0, "seq", [1, 2], [3], 4, SamplingParams())])
    await asyncio.sleep(0.05)
    [result] = posted
    assert (result.call_id, result.sequence_id, result.token_ids) == (7, "seq", [])
    assert "cancelled" in result.error


async def test_draft_calls_run_in_no_client_requests_context():
    """The core's reports are read from the first request's task: the calls they start must not carry that
    request's context (Serve files a handle call under it, and cancels it with that request)."""
    seen = []

    async def client(call):
        seen.append(REQUEST_ID.get())
        return DraftResult(call.call_id, call.drafter, call.sequence_id, [])

    speculative = {"drafter": "model", "draft": "d", "num_speculative_tokens": 4}
    config = AppConfig.from_args({"models": [{"model": {"source": "t"}, "engine": {"separate_process": False, "speculative": speculative}},
                                             {"model": {"source": "d"}}]}).models[0]
    server = fake_model_server(config, draft_client=client)

    async def one(request_id: str, max_tokens: int):
        REQUEST_ID.set(request_id)
        request = Request(request_id, list(b"hello world"), SamplingParams(max_tokens=max_tokens, temperature=0), drafter=0)
        async for _ in server.engine.generate(request):
            pass

    try:
        await asyncio.create_task(one("first", 3))
        await asyncio.create_task(one("second", 6))
    finally:
        server.shutdown(1)
    assert seen and set(seen) == {None}
