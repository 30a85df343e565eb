"""Several engine requests behind one OpenAI request: a list of prompts, ``n`` choices, ``best_of`` candidates.

Each choice is its own engine request, so the engine batches them like any others and their prompt's KV is
computed once and shared through the prefix cache. Choice ``index`` = prompt_index * n + j, as vLLM orders
them. A seeded request's choice j draws from seed + j (as vLLM), so the same request gives the same choices
again. The requests of one OpenAI request stand or fall together: the first failure cancels the others (their
engine requests are aborted) and is the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from app.api.errors import APIError, rejection_reason
from app.engine import RequestOutput, SamplingParams
from app.engine.request import INT64_MAX, INT64_MIN, TokenLogprob

MAX_CHOICES = 128  # choices (n, best_of) per prompt, as OpenAI's n limit
# Engine requests one OpenAI request may fan out to (prompts x best_of) before any prompt is tokenized; past the
# replica's own bound (engine.max_num_seqs + engine.max_queued_requests, fan_out) it is a 400 too
MAX_GENERATIONS = 4096


@dataclass
class Prepared:
    """One engine request of an OpenAI request (one choice, or one candidate of ``best_of``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    created: int
    model: str  # the name the client asked for (answers carry it)
    drafter: int | None  # which of the engine's drafters drafts for it (None: none)
    response_id: str = ""  # the OpenAI response's id (the first engine request's)
    index: int = 0  # its choice index: prompt_index * n + j
    prompt_index: int = 0
    echo: str | None = None  # sent before the answer: a completion's prompt, a chat's continued message (echo)
    last: RequestOutput | None = None  # its last output, once it has one
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sampling.prompt_logprobs: from its first output
    prompt_only: bool = False  # completions' max_tokens 0 with echo: the prompt scored; the one token computed is no answer
    first_of_prompt: bool = True  # its prompt's first choice: the prompt counts once in the metrics, as in the usage
    token_ids: list[int] | None = None  # the tokens generated so far (a list of its own once generation begins)
    logprobs_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    cache_salt: str | None = None  # vLLM's: its prompt's KV shared only with requests of the same salt
    reasoning_inside: bool | None = None  # a reasoning parser's: whether the answer starts thinking (None: no split)
    reasoning_shown: bool = True  # include_reasoning: false leaves the thinking out
    call_ends_thinking: str | None = None  # Qwen3's: a call's marker while thinking ends the thinking there, as vLLM reads it
    reservation: Any = None  # the places its OpenAI request holds (hold_room): it takes its own as it starts

    def __post_init__(self) -> None:
        self.response_id = self.response_id or self.request_id


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: seed + j, wrapped into int64."""
    if seed is None:
        return None
    return (seed + j - INT64_MIN) % 2**64 + INT64_MIN if seed + j > INT64_MAX else seed + j


async def gather_or_cancel(awaitables: Sequence[Awaitable]) -> list:
    """All results in order; at the first failure the others are cancelled (and awaited), then it is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merged(streams: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from several async iterators, as each item comes; a failure in one ends them all.
    Closing this iterator (a client gone) cancels every stream, which aborts their engine requests."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, done))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best_candidates(plans: list, results: list, n: int) -> list:
    """best_of: each prompt's ``n`` candidates (plan, (text, last output, logprobs)) with the highest log-probability
    (sum over their tokens), best first, prompt after prompt."""
    kept = []
    for prompt_index in sorted({p.prompt_index for p in plans}):
        candidates = [(p, r) for p, r in zip(plans, results) if p.prompt_index == prompt_index]
        candidates.sort(key=lambda pr: -sum(lp.logprob for lp in pr[1][2] or []))
        kept.extend(candidates[:n])
    return kept


def num_prompts(plans: list) -> int:
    return len({p.prompt_index for p in plans})

def fan_out(prepared: list[Prepared], count: int, n: int | None, holds: int | None) -> list[Prepared]:
    """``count`` engine requests per prompt (choice j: seed + j), indexed prompt_index * n + j; ``holds``: the most
    generations the replica ever holds at once (more could never start: a 400)."""
    if len(prepared) == 1 and count == 1:
        return prepared
    if holds is not None and len(prepared) * count > holds:
        raise APIError(400, f"{len(prepared)} prompt(s) x {count} choices is more generations than this replica holds "
                       f"at once ({holds}: engine.max_num_seqs + engine.max_queued_requests); send fewer",
                       param="n" if count > 1 else "prompt")
    n, base, response_id = n or count, prepared[0].request_id, prepared[0].response_id
    plans: list[Prepared] = []
    for prompt_index, p in enumerate(prepared):
        for j in range(count):
            sampling = dataclasses.replace(p.sampling, seed=choice_seed(p.sampling.seed, j))
            plans.append(dataclasses.replace(p, request_id=f"{base}-{len(plans)}", sampling=sampling, response_id=response_id,
                                             created=prepared[0].created, index=prompt_index * n + j,
                                             prompt_index=prompt_index, first_of_prompt=j == 0))
    return plans


def hold_room(engine, metrics, plans: list[Prepared]) -> Any:
    """Hold the places of an OpenAI request's generations (``AsyncEngine.reserve``; each plan takes its own as it
    starts), or refuse the request whole, counted once as a rejection (in no latency figure): never some of its choices
    run, then aborted with it. The caller gives back what is left (``release``) as the request ends."""
    reservation = _counted_if_refused(metrics, lambda: engine.reserve(len(plans)))
    for plan in plans:
        plan.reservation = reservation
    return reservation


def still_accepting(engine, metrics, plan: Prepared) -> None:
    """Whether the engine still takes a plan as it starts (it may have died or begun draining since its place was
    held; a plan with no place held is checked for one)."""
    _counted_if_refused(metrics, lambda: engine.check_accepting(reserved=plan.reservation is not None))


def _counted_if_refused(metrics, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        metrics.record_rejection(rejection_reason(exc))
        raise


def drafter_for(names: list[str | None], model: str) -> int | None:
    """The drafter serving the name a request was sent to: its own, else an unnamed one, else none."""
    if model in names:
        return names.index(model)
    return names.index(None) if None in names else None


def usage(plans: list[Prepared]) -> dict:
    """Each prompt counted once; every generated token (best_of's candidates too: they were computed)."""
    prompt = sum({p.prompt_index: len(p.prompt_token_ids) for p in plans}.values())
    completion = sum(p.last.num_output_tokens for p in plans if p.last is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
