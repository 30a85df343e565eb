"""A load generator for any OpenAI-compatible server: N streaming completions at a given concurrency.

Measures what a client sees (over HTTP, streaming): output tokens per second over the whole run,
time to first token (TTFT), time per output token (TPOT = (E2E - TTFT) / (tokens - 1)), inter-token
latency (ITL) and end-to-end latency (E2E), as percentiles. Prompts are random common words from a
fixed seed, so runs are comparable; ``ignore_eos`` + ``min_tokens`` make every request produce
exactly ``max_tokens`` tokens (the standard workload of ../shared/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


@dataclass
class LoadSpec:
    base_url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    num_requests: int = 32
    concurrency: int = 32
    prompt_words: int = 56  # ~64 tokens with SmolLM2's tokenizer
    max_tokens: int = 128
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestTiming:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


def make_prompts(spec: LoadSpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [" ".join(rng.choice(WORDS) for _ in range(spec.prompt_words)) for _ in range(spec.num_requests)]


async def run_load(spec: LoadSpec) -> dict:
    """Send every request (``concurrency`` at a time) and summarize what the client measured."""
    limit = asyncio.Semaphore(spec.concurrency)
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=spec.base_url, timeout=spec.timeout_s, limits=limits) as http:

        async def one(prompt: str) -> RequestTiming | str:
            async with limit:
                try:
                    return await _stream_one(http, spec, prompt)
                except (httpx.HTTPError, RuntimeError) as exc:  # counted and reported, not fatal to the run
                    return f"{type(exc).__name__}: {exc}"

        started = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in make_prompts(spec)))
        wall_s = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, str)]
    summary = summarize(spec, [r for r in results if not isinstance(r, str)], wall_s)
    summary["num_errors"] = len(errors)
    if errors:
        summary["first_error"] = errors[0][:500]
    return summary


async def _stream_one(http: httpx.AsyncClient, spec: LoadSpec, prompt: str) -> RequestTiming:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage: dict = {}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if not arrivals:
        raise RuntimeError("the server streamed no text")
    done = time.perf_counter()
    return RequestTiming(
        ttft_s=arrivals[0] - sent,
        e2e_s=done - sent,
        prompt_tokens=usage.get("prompt_tokens", 0),
        output_tokens=usage.get("completion_tokens", len(arrivals)),
        itl_s=[b - a for a, b in zip(arrivals, arrivals[1:])],
    )


def summarize(spec: LoadSpec, timings: list[RequestTiming], wall_s: float) -> dict:
    if not timings:
        return {"spec": asdict(spec), "num_requests": 0, "wall_s": round(wall_s, 3), "output_tok_per_s": 0.0}
    output_tokens = sum(t.output_tokens for t in timings)
    return {
        "spec": asdict(spec),
        "num_requests": len(timings),
        "wall_s": round(wall_s, 3),
        "output_tokens": output_tokens,
        "mean_prompt_tokens": round(statistics.mean(t.prompt_tokens for t in timings), 1),
        "output_tok_per_s": round(output_tokens / wall_s, 1),
        "ttft_s": percentiles([t.ttft_s for t in timings]),
        "tpot_ms": percentiles([t.tpot_s * 1000 for t in timings]),
        "itl_ms": percentiles([x * 1000 for t in timings for x in t.itl_s]),
        "e2e_s": percentiles([t.e2e_s for t in timings]),
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": round(at(0.5), 4), "p90": round(at(0.9), 4), "p99": round(at(0.99), 4), "mean": round(statistics.mean(ordered), 4)}
