"""A load generator for any OpenAI-compatible server: N streaming requests at a given concurrency.

Measures what a client sees (over HTTP, streaming): output tokens per second over the whole run,
time to first token (TTFT), time per output token (TPOT = (E2E - TTFT) / (tokens - 1)), inter-token
latency (ITL: the time between streamed chunks, what a reader of the stream sees) and end-to-end
latency (E2E), as percentiles; and goodput, the requests per second that met a latency objective (SLO:
TTFT at most ``slo_ttft_s`` and the request's p99 inter-token gap at most ``slo_itl_ms``), with the
fraction of requests that met it. Prompts come from a fixed seed, so runs are comparable;
``ignore_eos`` + ``min_tokens`` make every request produce exactly ``max_tokens`` tokens.

Workloads (``LoadSpec.workload``):

- ``random`` (W1, W2): 56-token prompts of random common words through ``/v1/completions``.
- ``shared-prefix-chat`` (W3): chats through ``/v1/chat/completions`` that all begin with the same
  ~400-token system prompt (``system_prompt_words``), each with its own short question: what prefix
  caching saves.
- ``rewrite`` (W4): "rewrite this passage" chats whose answer copies from the prompt (input-grounded
  generation, where drafts looked up in the prompt are accepted).
- ``mixed`` (W5): 8 streams of ``random`` requests decode; once each has streamed, a ~1,670-token prompt arrives
  (its first words a fresh nonce, so no prefix cache holds it). What a chat product with retrieval prompts sees:
  the streams' largest gap between chunks while that prompt is prefilled, and the long prompt's TTFT.

Every stream also reports its chunks that carry a token beside the tokens the server counted: a server that
batches tokens into fewer chunks, or drops some, shows as ``chunks != tokens``. A chunk with empty text counts (a
token with no text of its own: a special token left out of the text, a partial character), unless it only opens
a chat stream (the role) or only closes one (a finish reason).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from app.bench.percentiles import goodput, percentiles, quantile
from app.bench.prompts import DAYS, PASSAGES, QUESTIONS, REWRITE_INSTRUCTIONS, SYSTEM_FACTS, SYSTEM_RULES, WORDS

WORKLOADS = ("random", "shared-prefix-chat", "rewrite", "mixed")
MIXED_STREAMS = 8
MIXED_LONG_PROMPT_WORDS = 1650  # ~1,670 tokens with SmolLM2's tokenizer


@dataclass
class LoadSpec:
    base_url: str = "http://127.0.0.1:8000"
    model: str = "smollm2-135m-instruct"
    num_requests: int = 32
    concurrency: int = 32
    prompt_words: int = 56  # 56 tokens with SmolLM2's tokenizer
    max_tokens: int = 128
    seed: int = 0
    timeout_s: float = 600.0
    workload: str = "random"  # one of WORKLOADS
    system_prompt_words: int = 350  # shared-prefix-chat: ~400 tokens
    slo_ttft_s: float = 2.0
    slo_itl_ms: float = 200.0


@dataclass
class RequestTiming:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed chunks that carried a token

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)

    def record(self) -> dict:
        """What the JSON keeps of one request: enough to recompute goodput under another SLO."""
        gaps_ms = sorted(x * 1000 for x in self.itl_s)
        return {"ttft_s": round(self.ttft_s, 4), "e2e_s": round(self.e2e_s, 4), "output_tokens": self.output_tokens,
                "itl_p99_ms": round(quantile(gaps_ms, 0.99), 2) if gaps_ms else 0.0,
                "itl_max_ms": round(gaps_ms[-1], 2) if gaps_ms else 0.0}


def make_prompts(spec: LoadSpec) -> list[str]:
    """The ``random`` workload's prompts (also used offline by the engine and transformers baselines)."""
    rng = random.Random(spec.seed)
    return [" ".join(rng.choice(WORDS) for _ in range(spec.prompt_words)) for _ in range(spec.num_requests)]


def system_prompt(words: int) -> str:
    """The shared system prompt: rules, then facts repeated as a numbered list until ``words`` words."""
    parts, count, n = [SYSTEM_RULES, "Facts:"], len(SYSTEM_RULES.split()) + 1, 0
    while count < words:
        fact = f"{n + 1}. {SYSTEM_FACTS[n % len(SYSTEM_FACTS)]}"
        parts.append(fact)
        count += len(fact.split())
        n += 1
    return "\n".join(parts)


def make_requests(spec: LoadSpec) -> tuple[str, list[dict]]:
    """The endpoint and the per-request body fields (prompt or messages) of ``spec.workload``."""
    if spec.workload == "random":
        return "/v1/completions", [{"prompt": p} for p in make_prompts(spec)]
    rng = random.Random(spec.seed)
    if spec.workload == "shared-prefix-chat":
        system = system_prompt(spec.system_prompt_words)
        bodies = []
        for i in range(spec.num_requests):
            question = QUESTIONS[i % len(QUESTIONS)].format(day=rng.choice(DAYS), topic=" ".join(rng.sample(WORDS, 2)))
            bodies.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
        return "/v1/chat/completions", bodies
    if spec.workload == "rewrite":
        bodies = []
        for i in range(spec.num_requests):
            passage = PASSAGES[i % len(PASSAGES)]
            instruction = REWRITE_INSTRUCTIONS[(i // len(PASSAGES)) % len(REWRITE_INSTRUCTIONS)]
            bodies.append({"messages": [{"role": "user", "content": instruction.format(passage=passage)}]})
        return "/v1/chat/completions", bodies
    raise ValueError(f"unknown workload {spec.workload!r}: one of {', '.join(WORKLOADS)}")


async def run_load(spec: LoadSpec, progress: bool | str = False) -> dict:
    """Send every request (``concurrency`` at a time) and summarize what the client measured.

    ``progress``: show a progress bar of finished requests (a string: its label)."""
    path, bodies = make_requests(spec)
    limit = asyncio.Semaphore(spec.concurrency)
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    bar = _progress_bar(len(bodies), progress)
    async with httpx.AsyncClient(base_url=spec.base_url, timeout=spec.timeout_s, limits=limits) as http:

        async def one(fields: dict) -> RequestTiming | str:
            async with limit:
                try:
                    return await _stream_one(http, spec, path, fields)
                except (httpx.HTTPError, RuntimeError) as exc:  # counted and reported, not fatal to the run
                    return f"{type(exc).__name__}: {exc}"
                finally:
                    if bar is not None:
                        bar.update(1)

        started = time.perf_counter()
        try:
            results = await asyncio.gather(*(one(b) for b in bodies))
        finally:
            if bar is not None:
                bar.close()
        wall_s = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, str)]
    summary = summarize(spec, [r for r in results if not isinstance(r, str)], wall_s)
    summary["num_errors"] = len(errors)
    if errors:
        summary["first_error"] = errors[0][:500]
        summary["goodput"] = goodput(summary.get("requests", []), wall_s, spec.slo_ttft_s, spec.slo_itl_ms, len(errors))
    return summary


def _progress_bar(total: int, progress: bool | str):
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=progress if isinstance(progress, str) else "requests", unit="req", file=sys.stderr,
                leave=False, dynamic_ncols=True)


async def run_mixed(spec: LoadSpec) -> dict:
    """W5: ``MIXED_STREAMS`` streams decode; once each has streamed a chunk, one ~1,670-token prompt arrives."""
    bodies = [{"prompt": p} for p in make_prompts(LoadSpec(**{**spec.__dict__, "num_requests": MIXED_STREAMS}))]
    rng = random.Random()
    long_prompt = f"Note {rng.getrandbits(64):016x}: " + " ".join(rng.choice(WORDS) for _ in range(MIXED_LONG_PROMPT_WORDS))
    limits = httpx.Limits(max_connections=MIXED_STREAMS + 1, max_keepalive_connections=MIXED_STREAMS + 1)
    async with httpx.AsyncClient(base_url=spec.base_url, timeout=spec.timeout_s, limits=limits) as http:
        started = [asyncio.Event() for _ in bodies]
        streams = [asyncio.create_task(_stream_one(http, spec, "/v1/completions", body, started[i])) for i, body in enumerate(bodies)]
        began = time.perf_counter()
        await _all_started(started, streams, spec.timeout_s)
        arrived = time.perf_counter()
        long_spec = LoadSpec(**{**spec.__dict__, "max_tokens": 16})
        results = await asyncio.gather(_stream_one(http, long_spec, "/v1/completions", {"prompt": long_prompt}), *streams,
                                       return_exceptions=True)
        wall_s = time.perf_counter() - began
    long, stream_results = results[0], results[1:]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    timings = [r for r in stream_results if isinstance(r, RequestTiming)]
    summary = summarize(spec, timings, wall_s)
    summary["num_errors"] = len(errors)
    if errors:
        summary["first_error"] = errors[0][:500]
        summary["goodput"] = goodput(summary.get("requests", []), wall_s, spec.slo_ttft_s, spec.slo_itl_ms, len(errors))
    summary["mixed"] = {
        "streams": MIXED_STREAMS, "arrived_after_s": round(arrived - began, 3),
        "stream_gap_max_ms": round(max((max(t.itl_s, default=0.0) for t in timings), default=0.0) * 1000, 1),
        "long_prompt_tokens": long.prompt_tokens if isinstance(long, RequestTiming) else None,
        "long_prompt_ttft_s": round(long.ttft_s, 3) if isinstance(long, RequestTiming) else None,
    }
    return summary


async def _all_started(started: list[asyncio.Event], streams: list[asyncio.Task], timeout_s: float) -> None:
    """Wait until every stream has streamed text (a stream that fails first ends the wait: its error is reported)."""
    waits = [asyncio.create_task(event.wait()) for event in started]
    pending = set(waits) | set(streams)
    deadline = time.perf_counter() + timeout_s
    while not all(event.is_set() for event in started) and not any(task.done() and task.exception() for task in streams):
        done, pending = await asyncio.wait(pending, timeout=max(deadline - time.perf_counter(), 0), return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
    for wait in waits:
        wait.cancel()


async def _stream_one(http: httpx.AsyncClient, spec: LoadSpec, path: str, fields: dict,
                      first_text: asyncio.Event | None = None) -> RequestTiming:
    body = {
        "model": spec.model,
        **fields,
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    arrivals: list[float] = []  # chunks with text: what a reader of the stream sees
    token_chunks = 0
    usage: dict = {}
    finished = False
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                finished = True
            if not line.startswith("data: ") or finished:
                continue
            chunk = _event(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            choice = (chunk.get("choices") or [None])[0]
            token_chunks += choice is not None and _carries_a_token(choice)
            if choice is not None and _chunk_text(choice):
                arrivals.append(time.perf_counter())
                if first_text is not None:
                    first_text.set()
            usage = chunk.get("usage") or usage
    if not arrivals:
        raise RuntimeError("the server streamed no text")
    done = time.perf_counter()
    # Every request asks for exactly max_tokens (min_tokens = max_tokens, ignore_eos): a stream cut short, or one
    # that never said [DONE], failed, whatever it streamed before.
    if "completion_tokens" not in usage:  # counted from chunks instead, the chunks-per-token check would hold by itself
        raise RuntimeError("the stream carried no usage (stream_options.include_usage): its tokens cannot be counted")
    output_tokens = usage["completion_tokens"]
    if not finished or output_tokens != spec.max_tokens:
        raise RuntimeError(f"incomplete stream: {output_tokens} of {spec.max_tokens} tokens" + ("" if finished else ", no [DONE]"))
    return RequestTiming(
        ttft_s=arrivals[0] - sent,
        e2e_s=done - sent,
        prompt_tokens=usage.get("prompt_tokens", 0),
        output_tokens=output_tokens,
        itl_s=[b - a for a, b in zip(arrivals, arrivals[1:])],
        chunks=token_chunks,
    )


def _event(data: str) -> dict:
    """One server-sent event's JSON; a malformed one fails its request, not the whole run."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise RuntimeError(f"malformed event {data[:100]!r}: {exc}") from None


def _chunk_text(choice: dict) -> str:
    """A streamed choice's new text: ``text`` for completions, ``delta.content`` for chat."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _carries_a_token(choice: dict) -> bool:
    """Text, or an empty delta in mid-stream (a token with no text of its own); not a chat stream's opening role
    announcement, nor a closing chunk with only a finish reason."""
    if _chunk_text(choice):
        return True
    delta = choice.get("delta")
    return choice.get("finish_reason") is None and not (delta or {}).get("role") and (delta is not None or "text" in choice)


def summarize(spec: LoadSpec, timings: list[RequestTiming], wall_s: float) -> dict:
    if not timings:
        return {"spec": asdict(spec), "num_requests": 0, "wall_s": round(wall_s, 3), "output_tok_per_s": 0.0}
    output_tokens = sum(t.output_tokens for t in timings)
    records = [t.record() for t in timings]
    return {
        "spec": asdict(spec),
        "num_requests": len(timings),
        "wall_s": round(wall_s, 3),
        "output_tokens": output_tokens,
        "mean_prompt_tokens": round(statistics.mean(t.prompt_tokens for t in timings), 1),
        "output_tok_per_s": round(output_tokens / wall_s, 1),
        "request_per_s": round(len(timings) / wall_s, 3),
        "ttft_s": percentiles([t.ttft_s for t in timings]),
        "tpot_ms": percentiles([t.tpot_s * 1000 for t in timings]),
        "itl_ms": percentiles([x * 1000 for t in timings for x in t.itl_s]),
        "streamed_chunks": sum(t.chunks for t in timings),
        "e2e_s": percentiles([t.e2e_s for t in timings]),
        "goodput": goodput(records, wall_s, spec.slo_ttft_s, spec.slo_itl_ms),
        "requests": records,
    }


# --- standard workloads, sweeps -----------------------------------------------------------------------------


# Each phase of a run draws its own prompts (the run's seed plus these), the same for every server: a server keeps what
# it computed for earlier phases, and a prefix cache with blocks smaller than a prompt (ours: 16 tokens; vLLM's CPU
# backend: 128) would serve repeats of them from its cache. W1 keeps the run's seed, as it always had.
PHASE_SEEDS = {"W1": 0, "W2": 2, "W3": 3, "W4": 4, "W5": 5, "warm-up": 1000, "sweep": 2000}


def workload_spec(name: str, spec: LoadSpec, **overrides) -> LoadSpec:
    """W1-W4 on top of ``spec`` (its model, URL, token counts, seed and SLO): W1 = ``spec`` as given
    (32 at once by default), W2 = 8 one at a time, W3 = the shared-prefix chats at W1's concurrency,
    W4 = the rewrites at W1's concurrency."""
    fields = dict(spec.__dict__)
    if name == "W1":
        fields["workload"] = "random"
    elif name == "W2":
        fields.update(workload="random", num_requests=8, concurrency=1)
    elif name == "W3":
        fields["workload"] = "shared-prefix-chat"
    elif name == "W4":
        fields["workload"] = "rewrite"
    elif name == "W5":
        fields.update(workload="mixed", num_requests=MIXED_STREAMS, concurrency=MIXED_STREAMS, max_tokens=256)
    else:
        raise ValueError(f"unknown workload {name!r}: W1, W2, W3, W4 or W5")
    fields["seed"] = spec.seed + PHASE_SEEDS[name]
    fields.update(overrides)
    return LoadSpec(**fields)


STANDARD_WORKLOADS = ("W1", "W2", "W3", "W4", "W5")


def warm_up(spec: LoadSpec) -> None:
    """Two short requests: the first requests pay one-time costs (allocator, kernels, compilation)."""
    kind = "random" if spec.workload == "mixed" else spec.workload
    asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "workload": kind, "num_requests": 2, "concurrency": 2, "max_tokens": 8,
                                     "seed": spec.seed + PHASE_SEEDS["warm-up"]})))


def run_workloads(spec: LoadSpec, names, progress: bool = False, label: str = "", warm: bool = True) -> dict:
    """Run the named standard workloads one after another against ``spec.base_url``, each after a warm-up
    of two short requests of its own kind (first requests of a shape pay one-time costs)."""
    results = {}
    for name in names:
        named = workload_spec(name, spec)
        if warm:
            warm_up(named)
        if name == "W5":
            results[name] = asyncio.run(run_mixed(named))
            mixed = results[name]["mixed"]
            print(f"{label} W5: streams' largest gap {mixed['stream_gap_max_ms']} ms, long prompt "
                  f"({mixed['long_prompt_tokens']} tokens) TTFT {mixed['long_prompt_ttft_s']} s", flush=True)
            continue
        results[name] = asyncio.run(run_load(named, progress=f"{label} {name}".strip() if progress else False))
        r = results[name]
        print(f"{label} {name}: {r.get('output_tok_per_s')} tok/s, TTFT p50 {r.get('ttft_s', {}).get('p50')} s, "
              f"goodput {r.get('goodput', {}).get('fraction')}", flush=True)
    return results


def run_sweep(spec: LoadSpec, concurrencies, rounds: int = 2, min_requests: int = 8, progress: bool = False) -> dict:
    """The ``spec`` workload at each concurrency, ``max(rounds x concurrency, min_requests)`` requests each."""
    levels = {}
    for concurrency in concurrencies:
        level = LoadSpec(**{**spec.__dict__, "concurrency": concurrency, "num_requests": max(rounds * concurrency, min_requests),
                            "seed": spec.seed + PHASE_SEEDS["sweep"] + concurrency})
        levels[str(concurrency)] = asyncio.run(run_load(level, progress=f"concurrency {concurrency}" if progress else False))
        r = levels[str(concurrency)]
        print(f"concurrency {concurrency}: {r.get('output_tok_per_s')} tok/s, TTFT p50 {r.get('ttft_s', {}).get('p50')} s, "
              f"ITL p50 {r.get('itl_ms', {}).get('p50')} ms, goodput {r.get('goodput', {}).get('req_per_s')} req/s", flush=True)
    return levels
