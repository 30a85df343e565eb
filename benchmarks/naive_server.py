"""The naive baseline: FastAPI + transformers, one request at a time, no batching, no Ray.

    .venv/bin/python benchmarks/naive_server.py [--model DIR] [--dtype bfloat16] [--port 8001]
    .venv/bin/python -m app.bench peer --url http://127.0.0.1:8001 --name naive --model smollm2-135m-instruct

What a first server around a Hugging Face model looks like: each request runs ``model.generate`` (greedy)
while the others wait on a lock, and a streamed request is sent as server-sent events from
an ``AsyncTextIteratorStreamer`` (text comes out word by word, as the streamer releases it). It answers
``POST /v1/completions`` (``prompt``, ``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stream``,
``stream_options.include_usage``; sampling parameters are accepted and ignored: always greedy),
``POST /v1/chat/completions`` (the same with ``messages``, through the tokenizer's chat template),
``GET /v1/models`` and ``GET /health``.

The default model is the embedded SmolLM2-135M-Instruct as the project prepares it
(``python -m app prepare``: ``$LLM_SERVE_CACHE`` or ``~/.cache/llm-serve``, then ``smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AsyncTextIteratorStreamer, StoppingCriteria, StoppingCriteriaList

DEFAULT_NAME = "smollm2-135m-instruct"


def default_checkpoint() -> Path:
    """Where ``python -m app prepare`` leaves the embedded model's HF checkpoint."""
    return Path(os.environ.get("LLM_SERVE_CACHE") or Path.home() / ".cache" / "llm-serve") / DEFAULT_NAME


class _Cancelled(StoppingCriteria):
    """Stops ``generate`` at the next token once the client has gone away."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def _parse(body: Any, served_name: str, chat: bool = False) -> dict | JSONResponse:
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            return _error(400, "messages must be a non-empty list of {role, content}")
        prompt = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return _error(400, "prompt must be a non-empty string (one prompt per request)")
    if body.get("model") not in (None, served_name):
        return _error(404, f"model {body.get('model')!r} is not served here (only {served_name!r})")
    max_tokens, min_tokens = body.get("max_tokens", 16), body.get("min_tokens", 0) or 0
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(400, "max_tokens must be a positive integer")
    if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        return _error(400, "min_tokens must be an integer between 0 and max_tokens")
    options = body.get("stream_options") or {}
    return {"prompt": prompt, "chat": chat, "max_tokens": max_tokens, "min_tokens": max_tokens if body.get("ignore_eos") else min_tokens,
            "stream": bool(body.get("stream")), "include_usage": bool(options.get("include_usage"))}


def create_app(model, tokenizer, served_name: str = DEFAULT_NAME) -> FastAPI:
    """The server around an already loaded ``model`` (``generate``) and ``tokenizer`` (``encode``/``decode``)."""
    app = FastAPI(title="naive transformers server")
    one_at_a_time = threading.Lock()  # held by the thread running generate, so even a cancelled request finishes first
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None)

    def generate(request: dict, input_ids: torch.Tensor, streamer=None, cancelled: _Cancelled | None = None) -> torch.Tensor:
        kwargs = {"max_new_tokens": request["max_tokens"], "do_sample": False, "pad_token_id": pad_token_id,
                  "attention_mask": torch.ones_like(input_ids)}
        if request["min_tokens"]:
            kwargs["min_new_tokens"] = request["min_tokens"]
        if cancelled is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([cancelled])
        with one_at_a_time, torch.inference_mode():
            return model.generate(input_ids, streamer=streamer, **kwargs)[0, input_ids.shape[1]:]

    def envelope(request: dict, request_id: str, created: int, text: str, finish_reason: str | None, chunk: bool = False) -> dict:
        if not request["chat"]:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {"id": request_id, "object": "text_completion", "created": created, "model": served_name, "choices": [choice]}
        message = {"content": text} if chunk else {"role": "assistant", "content": text}
        choice = {"index": 0, "delta" if chunk else "message": message, "finish_reason": finish_reason}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": request_id, "object": kind, "created": created, "model": served_name, "choices": [choice]}

    def prompt_ids(request: dict) -> list[int]:
        if not request["chat"]:
            return list(tokenizer.encode(request["prompt"]))
        text = tokenizer.apply_chat_template(request["prompt"], tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "naive"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        return await answer(_parse(body, served_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: dict):
        return await answer(_parse(body, served_name, chat=True))

    async def answer(request: dict | JSONResponse):
        if isinstance(request, JSONResponse):
            return request
        ids = prompt_ids(request)
        input_ids = torch.tensor([ids], dtype=torch.long)
        request_id, created = f"{'chatcmpl' if request['chat'] else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if not request["stream"]:
            output = await asyncio.to_thread(generate, request, input_ids)
            text = tokenizer.decode(output.tolist(), skip_special_tokens=True)
            finish = "length" if len(output) >= request["max_tokens"] else "stop"
            return {**envelope(request, request_id, created, text, finish), "usage": usage(len(ids), len(output))}
        return StreamingResponse(stream(request, input_ids, request_id, created), media_type="text/event-stream")

    async def stream(request: dict, input_ids: torch.Tensor, request_id: str, created: int):
        # Text reaches the event loop from the generating thread (call_soon_threadsafe): a stream waiting for the
        # lock holds no executor thread, so 32 waiting streams cannot starve the one that generates.
        streamer = AsyncTextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancelled, result = _Cancelled(), {}

        def run() -> None:
            try:
                result["output"] = generate(request, input_ids, streamer, cancelled)
            except Exception as exc:  # reported to the client in the stream
                result["error"] = f"{type(exc).__name__}: {exc}"
                streamer.end()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            async for text in streamer:
                if text:
                    yield f"data: {json.dumps(envelope(request, request_id, created, text, None, chunk=True))}\n\n"
            await asyncio.to_thread(thread.join)
            if "error" in result:
                yield f"data: {json.dumps({'error': {'message': result['error'], 'type': 'server_error'}})}\n\n"
            else:
                output = result["output"]
                finish = "length" if len(output) >= request["max_tokens"] else "stop"
                yield f"data: {json.dumps(envelope(request, request_id, created, '', finish, chunk=True))}\n\n"
                if request["include_usage"]:
                    final = {**envelope(request, request_id, created, "", None, chunk=True), "choices": [],
                             "usage": usage(input_ids.shape[1], len(output))}
                    yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            cancelled.event.set()  # the client left early: generate stops at its next token

    return app


def load(checkpoint: str | Path, dtype: str = "bfloat16"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_checkpoint()), help="HF checkpoint directory (default: the embedded model's)")
    parser.add_argument("--served-name", default=DEFAULT_NAME, help="the model name requests give")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "auto"],
                        help="weights and compute dtype (auto: the checkpoint's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    if not Path(args.model).is_dir():
        parser.error(f"{args.model} is not a directory: run `python -m app prepare` first, or give --model")
    import uvicorn

    model, tokenizer = load(args.model, args.dtype)
    uvicorn.run(create_app(model, tokenizer, args.served_name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
