"""How the ingress answers, over HTTP and to handle calls: every failure as an OpenAI-style error (its internals
only in the log, under the request's id), and streams as server-sent events."""

# No `from __future__ import annotations`: FastAPI must see real types (e.g. Request) where these are used.
import asyncio
import functools
import json
import logging
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.api.bodies import json_object
from app.api.errors import APIError, to_api_error
from app.api.protocol import parse_body
from deployments.ray_compat import serve_request_id

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the Retry-After of 429 and 503 answers


def request_id_of(raw: Request | None = None) -> str:
    """Serve's id for the request being served: its proxy returns it to HTTP clients as the x-request-id header
    and its log lines carry it (else the request's own header, else a fresh id: ``ray_compat.py``)."""
    return serve_request_id(raw.headers if raw is not None else None)


async def parsed(body: Any, request_cls: type, stream: bool | None = None):
    """The request, parsed off the event loop, where the streams of the model this replica hosts wait: a large body's
    validation, and a structured output's grammar where a check needs it (tens of ms for a large schema). ``stream``:
    a handle method's own (its body a dict, or JSON text or bytes as HTTP sends it)."""
    def parse():
        given = body if stream is None else {**json_object(body), "stream": stream}
        return parse_body(given, request_cls)

    return await asyncio.to_thread(parse)


def reported(exc: BaseException, request_id: str) -> APIError:
    """What the caller gets for ``exc``; a failure on our side goes to the log, traceback and all, under the same id."""
    error = to_api_error(exc, request_id)
    if error.status >= 500:
        logger.error("request %s failed: %d %s", request_id, error.status, error.code, exc_info=exc)
    return error


async def guarded(response: Awaitable[Any], request_id: str) -> Any:
    """Await a route's work; any failure becomes an OpenAI-style error response."""
    try:
        return await response
    except Exception as exc:  # every error, expected or not, reaches the client in one shape
        error = reported(exc, request_id)
        # A full queue or a replica being replaced clears within seconds: tell clients when to come back.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
        return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)


async def json_answer(body: dict) -> JSONResponse:
    """A whole answer as JSON; one with logprobs written off the event loop, where every stream of the replica waits
    (an echoed 5.4k-token prompt's, 20 alternatives each: ~0.4 s)."""
    if not any(isinstance(choice, dict) and (choice.get("logprobs") or choice.get("prompt_logprobs"))
               for choice in body.get("choices") or ()):
        return JSONResponse(body)
    return await asyncio.to_thread(JSONResponse, body)


def raises_api_errors(method):
    """A handle method's failure reaches the calling Ray job as the APIError an HTTP client would read."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        request_id = request_id_of()
        try:
            return await method(self, *args, **kwargs)
        except Exception as exc:
            raise reported(exc, request_id) from None  # the cause would carry the internals along

    return wrapper


def streams_api_errors(method):
    """The same for a streaming handle method: a failure ends the stream with that APIError."""

    @functools.wraps(method)
    async def wrapper(self, body):
        request_id = request_id_of()
        try:
            async for chunk in method(self, body):
                yield chunk
        except Exception as exc:
            raise reported(exc, request_id) from None

    return wrapper


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes (max_request_bytes)", code="request_too_large")


async def sse_response(chunks: AsyncIterator[dict], request_id: str, named: bool = False) -> StreamingResponse:
    """Wait for the first chunk first, so that a bad request still gets its HTTP error status. ``named``: the
    Responses API's events, each under its type's name, with no ``[DONE]``."""
    first = await chunks.__anext__()
    return StreamingResponse(_sse_events(first, chunks, request_id, named), media_type="text/event-stream")


async def _sse_events(first: dict, rest: AsyncIterator[dict], request_id: str, named: bool) -> AsyncIterator[str]:
    yield await _sse_event(first, named)
    last = first
    try:
        async for last in rest:
            yield await _sse_event(last, named)
    except Exception as exc:  # headers are sent: report the error in-band, then end the stream
        error = reported(exc, request_id)
        if named:
            yield _sse({"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param,
                        "sequence_number": last.get("sequence_number", -1) + 1}, named)
            return
        yield _sse(error.to_dict())
    if not named:
        yield "data: [DONE]\n\n"


async def _sse_event(data: dict, named: bool) -> str:
    """A chunk carrying an echoed prompt's logprobs (thousands of entries: 5.4k tokens with 20 alternatives each
    dump in ~0.2 s) is written off the event loop, where every other stream of the replica waits."""
    large = any(len((choice.get("logprobs") or {}).get("tokens") or ()) > _LARGE_LOGPROBS
                for choice in data.get("choices") or () if isinstance(choice, dict) and isinstance(choice.get("logprobs"), dict))
    return await asyncio.to_thread(_sse, data, named) if large else _sse(data, named)


_LARGE_LOGPROBS = 256  # tokens in one chunk's logprobs: an echoed prompt's (a generated chunk has a few)


def _sse(data: dict, named: bool = False) -> str:
    event = f"event: {data['type']}\n" if named else ""
    return f"{event}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def as_generate_chunks(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    async for chunk in chunks:
        for choice in chunk["choices"]:
            yield {"text": choice["text"], "finish_reason": choice["finish_reason"]}
