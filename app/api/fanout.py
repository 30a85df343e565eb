"""Several engine requests behind one OpenAI request: a list of prompts, ``n`` choices, ``best_of`` candidates.

Each choice is its own engine request, so the engine batches them like any others and their prompt's KV is
computed once and shared through the prefix cache. Choice ``index`` = prompt_index * n + j, as vLLM orders
them. A seeded request's choice j draws from seed + j (as vLLM), so the same request gives the same choices
again. The requests of one OpenAI request stand or fall together: the first failure cancels the others (their
engine requests are aborted) and is the answer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Sequence

from app.engine.request import INT64_MAX, INT64_MIN

MAX_CHOICES = 128  # engine requests one OpenAI request may fan out to (prompts x best_of), as OpenAI's n limit


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
