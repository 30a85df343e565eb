"""The scheduler: which requests run in the next step, and how many of their tokens.

Requests are counters (vLLM v1): a request needs ``num_tokens - num_computed_tokens`` more tokens
through the model; a prefill is just a request with many, a decode one with one. Each step gets a
token budget: running requests go first (a decode costs one token, an unfinished prefill takes a
chunk), then waiting requests are admitted in arrival order while budget, sequence slots and KV
blocks last. When a running request cannot get a block, the newest running request is preempted by
recompute (its blocks are freed; it re-enters the waiting queue at the front and later re-prefills
its prompt plus what it already generated), so a step never runs out of memory. A decoding request
with draft tokens (speculative decoding) is "more tokens to verify": its one new token plus its drafts,
as far as the budget goes.

No tensors here: the scheduler and the block manager are tested without a model.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.kv_cache import BlockManager
from app.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    gang: bool = False  # dynamic batching: a new group is admitted only when nothing of the last one runs
    sliding_window: int | None = None  # every attention layer sees only its last this-many keys: older blocks go back


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, from request.num_computed_tokens on (drafts included)
    num_spec_tokens: int = 0  # of which draft tokens: the first num_spec_tokens of request.spec_token_ids

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so the step samples its next one (or more)."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """The contract between scheduler and runner for one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


StepSeconds = Callable[[int, float], float]  # a step's predicted seconds for (tokens, attended keys summed)


class Scheduler:
    BURST_STEPS = 15  # a burst of first tokens that bounded steps would spread over more steps goes first
    BURST_MAX_CHUNKS = 8  # a burst going first is split into at most this many steps (_burst_chunk)
    BURST_CHUNKS_GAIN = 0.95  # ... and only where that brings its first tokens >= 5% sooner on average than one step

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0
        self._active_group: int | None = None
        self._burst: tuple[frozenset[str], int] | None = None  # a burst going first in chunks: its requests, chunk

    # ---- request lifecycle -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def remove_request(self, request_id: str, park: bool = False) -> Request | None:
        """Take a request out (finished or aborted) and free its blocks at once; with ``park``, a request of a
        session leaves them to the session's next request instead (kv_cache.py: sessions)."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if park and request.session_id is not None:
                        self.blocks.park(request_id, request.session_id, request.all_token_ids[: request.num_computed_tokens])
                    else:
                        self.blocks.free(request_id)
                    return request
        return None

    # ---- one step --------------------------------------------------------------------------
    def schedule(self, decode_step_tokens: int | None = None, token_cap: int | None = None,
                 step_seconds: StepSeconds | None = None) -> SchedulerOutput:
        """``decode_step_tokens``: the most tokens a step may carry while some request decodes (stall-free
        chunked prefill: prefill chunks beside decodes get what is left; never fewer than one block of them),
        unless a burst waiting for its first tokens is better served by whole steps (``_burst_goes_first``); with
        nothing decoding, steps keep to it too where that brings several prompts' first tokens sooner
        (``_dribble_goes_sooner``). A burst going first is split into the chunks that bring its first tokens
        soonest on average by ``step_seconds``, the measured step cost (``_burst_chunk``; without it, one step).
        ``token_cap``: the most tokens any step may carry (below ``max_num_batched_tokens`` after out of memory)."""
        output = SchedulerOutput()
        limit = budget = min(self.config.max_num_batched_tokens, token_cap or self.config.max_num_batched_tokens)
        if decode_step_tokens is not None:
            decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not r.awaiting_draft]
            tokens = sum(1 + len(r.spec_token_ids) for r in decoding)
            bounded = max(decode_step_tokens, tokens + self.blocks.block_size)
            chunk = self._burst_in_progress()
            if chunk is not None:
                budget = min(budget, tokens + chunk)
            elif decoding and not self._burst_goes_first(len(decoding), tokens, bounded, limit):
                budget = min(budget, bounded)
            elif not decoding and self._dribble_goes_sooner(bounded):
                budget = min(budget, bounded)
            elif step_seconds is not None:
                budget = min(budget, tokens + self._burst_chunk(tokens, limit - tokens, step_seconds))
        budget = self._schedule_running(budget, output)
        if not output.preempted:  # memory is short: let the running requests drain first
            self._schedule_waiting(budget, output)
        return output

    def _burst_chunk(self, decode_tokens: int, room: int, step_seconds: StepSeconds) -> int:
        """The prompt tokens a step gives a burst going first (or a long prompt with nothing decoding): one whole
        step gives every first token at its end; chunks give the first prompts theirs after the first chunk, at the
        cost of one more step's fixed part a chunk, and of the decodes of those already done. The chunk whose steps
        bring the first tokens soonest on average (``mean_first_token_s`` by the measured step cost), of up to
        ``BURST_MAX_CHUNKS``, where it beats one whole step by ``BURST_CHUNKS_GAIN``; the chunk is kept for the
        burst's later steps (``_burst_in_progress``). A single prompt keeps the whole step: chunks only delay it."""
        firsts = self._waiting_for_first_tokens()
        prompts = [(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens) for r in firsts]
        total = sum(tokens for tokens, _ in prompts)
        if len(prompts) < 2 or room <= self.blocks.block_size:
            return room
        whole = min(total, room)
        candidates = {max(math.ceil(whole / k), self.blocks.block_size) for k in range(2, self.BURST_MAX_CHUNKS + 1)}
        means = {chunk: mean_first_token_s(prompts, chunk, decode_tokens, step_seconds) for chunk in candidates}
        best = min(means, key=means.__getitem__)
        if means[best] > self.BURST_CHUNKS_GAIN * mean_first_token_s(prompts, whole, decode_tokens, step_seconds):
            return room
        self._burst = frozenset(r.request_id for r in firsts), best
        return best

    def _burst_in_progress(self) -> int | None:
        """The chunk of a burst going first in chunks while some of its requests still wait for their first token."""
        if self._burst is None:
            return None
        requests, chunk = self._burst
        if any(r.request_id in requests for r in self._waiting_for_first_tokens()):
            return chunk
        self._burst = None
        return None

    def _burst_goes_first(self, num_decoding: int, decode_tokens: int, bounded: int, limit: int) -> bool:
        """Whether the requests waiting for their first token outnumber the streams, fit one step at the whole
        budget, and would take more than ``BURST_STEPS`` bounded steps (3 s at the 200 ms default). Then the burst
        goes ahead of the bound, in one whole step or a few chunks (``_burst_chunk``), and holds the streams back for
        that long: spread over that many bounded steps, the burst's last first token comes well after one whole step
        would have given it, and the streams run out of step, with fewer rows a step at their end. A burst of fewer
        bounded steps keeps the bound: its first tokens come sooner on average (measured in docs/engine.md)."""
        firsts = self._waiting_for_first_tokens()
        if len(firsts) <= num_decoding:
            return False
        prompt_tokens = sum(r.num_tokens - r.num_computed_tokens for r in firsts)
        bounded_steps = prompt_tokens / max(bounded - decode_tokens, 1)
        return bounded_steps > self.BURST_STEPS and decode_tokens + prompt_tokens <= limit

    def _dribble_goes_sooner(self, bounded: int) -> bool:
        """With nothing decoding, whether prompts waiting for their first tokens are better served by bounded steps
        than by one whole step: several of them, the first within one bounded step and all within ``BURST_STEPS``.
        One whole step gives every one of them its first token when the last prompt is done; bounded steps give the
        first few theirs after the first step, and so on, at little cost in rows a step, so half of them come sooner
        (as a burst arriving behind one stream is served: ``_burst_goes_first``). A single prompt, or one longer than
        a bounded step, still takes the whole budget: chunking it would only delay it."""
        firsts = self._waiting_for_first_tokens()
        if len(firsts) < 2 or firsts[0].num_tokens - firsts[0].num_computed_tokens > bounded:
            return False
        return sum(r.num_tokens - r.num_computed_tokens for r in firsts) <= bounded * self.BURST_STEPS

    def _waiting_for_first_tokens(self) -> list[Request]:
        """Requests still to give a first token that the next steps can prefill: those prefilling, then the waiting
        ones in the order they would be admitted, as far as free sequence slots (and, batching dynamically, the
        running group) go; a preempted request has had its first token."""
        firsts = [r for r in self.running if r.first_token_s is None and r.num_tokens - r.num_computed_tokens > 1]
        slots = max(self.config.max_num_seqs - len(self.running), 0)
        for request in itertools.islice(self.waiting, slots):
            if self.config.gang and self.running and request.group != self._active_group:
                break  # the next group waits for this one to finish
            if request.first_token_s is None:
                firsts.append(request)
        return firsts

    def update(self, output: SchedulerOutput, num_accepted: dict[str, int] | None = None) -> None:
        """Record what the runner computed, before the engine appends the sampled tokens.

        A request's KV is valid up to its last token plus the drafts the target accepted (``num_accepted``
        by request id): rejected drafts' positions are forgotten, and their blocks freed.
        """
        for item in output.scheduled:
            request = item.request
            accepted = (num_accepted or {}).get(request.request_id, 0) if item.num_spec_tokens else 0
            request.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens + accepted
            token_ids = request.all_token_ids + request.spec_token_ids[:accepted]
            self.blocks.cache_full_blocks(request.request_id, token_ids, request.num_computed_tokens, request.cache_salt)
            if item.num_spec_tokens > accepted:
                self.blocks.truncate(request.request_id, request.num_computed_tokens + 1)  # + the token sampled now
            if self.config.sliding_window:  # the next query (at num_computed_tokens) sees keys from here on
                self.blocks.release_before(request.request_id, request.num_computed_tokens - self.config.sliding_window + 1)

    def _schedule_running(self, budget: int, output: SchedulerOutput) -> int:
        index, drafted = 0, []
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.awaiting_draft:  # its drafts are on their way (app/spec/remote.py): the others go on
                index += 1
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            if not self._reserve(request, num_new, output):
                break  # the request preempted itself: it was the last one running
            output.scheduled.append(ScheduledRequest(request, num_new))
            if remaining == 1 and request.spec_token_ids:  # drafts follow the last token only
                drafted.append(output.scheduled[-1])
            budget -= num_new
            index += 1
        return self._add_drafts(drafted, budget)

    def _add_drafts(self, drafted: list[ScheduledRequest], budget: int) -> int:
        """Drafts take what is left once every running request has its token, in order, where their KV blocks are
        free: they are worth neither another request's token nor a preemption."""
        for item in drafted:
            request = item.request
            num_spec = min(len(request.spec_token_ids), budget)
            if num_spec > 0 and self.blocks.allocate(request.request_id, request.num_computed_tokens + 1 + num_spec):
                item.num_new_tokens += num_spec
                item.num_spec_tokens = num_spec
                budget -= num_spec
        return budget

    def _reserve(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Get blocks for ``num_new`` more tokens of a running request, preempting the newest if needed."""
        while not self.blocks.allocate(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        request.awaiting_draft = False
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)  # ahead of newer arrivals: it is older than they are
        self.num_preemptions += 1

    def _schedule_waiting(self, budget: int, output: SchedulerOutput) -> None:
        if self.config.gang and not self.running:
            self._active_group = None
        filling = self._blocks_filled(output.scheduled)
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.config.gang and self._active_group not in (None, request.group):
                break  # dynamic batching: the next group waits for this one to finish
            if self._filled_by_another(request, filling):
                deferred.append(self.waiting.popleft())  # next step, it finds those blocks in the prefix cache
                continue
            num_new = self._admit(request, budget)
            if num_new == 0:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.popleft()
            self.running.append(request)
            self._active_group = request.group
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            filling.update(self._blocks_filled(output.scheduled[-1:]))
        self.waiting.extendleft(reversed(deferred))

    def _blocks_filled(self, scheduled: list[ScheduledRequest]) -> set[bytes]:
        """The prefix hashes of the blocks that this step's prefill chunks complete."""
        if not self.waiting:
            return set()
        return {block_hash for item in scheduled if item.num_new_tokens > 1 + item.num_spec_tokens
                for block_hash in self.blocks.blocks_filled(item.request.request_id, item.request.all_token_ids,
                                                             item.request.num_computed_tokens + item.num_new_tokens - item.num_spec_tokens,
                                                             item.request.cache_salt)}

    def _filled_by_another(self, request: Request, filling: set[bytes]) -> bool:
        """Whether the first block ``request`` would compute is one a request in this step computes already:
        the choices of one prompt (n, best_of) or chats behind one system prompt, arriving together, would
        otherwise each compute (and hold) the shared prompt, since a block is cached only once computed."""
        if not filling or request.sampling.prompt_logprobs is not None or request.session_id is not None:
            return False
        return self.blocks.first_uncached_block(request.all_token_ids, request.cache_salt) in filling

    def _admit(self, request: Request, budget: int) -> int:
        """Attach cached prefix blocks and blocks for the first chunk; returns the chunk's size (0: no room)."""
        token_ids = request.all_token_ids
        cached, looked_up = None, False
        if request.session_id is not None and request.status is RequestStatus.WAITING:
            cached = self.blocks.resume(request.request_id, request.session_id, token_ids)  # its session's KV
        if not cached:  # (prompt logprobs need every prompt row computed: no cached prefix for them)
            looked_up = request.sampling.prompt_logprobs is None and self.blocks.enable_prefix_caching
            cached = self.blocks.find_cached_prefix(request.request_id, token_ids, request.cache_salt) if looked_up else 0
        num_new = min(len(token_ids) - cached, budget)
        if not self.blocks.allocate(request.request_id, cached + num_new):
            self.blocks.free(request.request_id)  # give back the prefix blocks it took
            return 0
        # the hit rate is the cache's on new requests (as vLLM's): a session's own KV resumed, no lookup, or a
        # preempted request finding its own blocks again is no query of it
        if looked_up and request.status is RequestStatus.WAITING:
            self.blocks.record_prefix_query(len(token_ids), cached)
        if request.status is RequestStatus.WAITING:  # first admission, not a resumed preemption
            request.num_cached_tokens = cached
            request.first_scheduled_s = time.monotonic()
        request.num_computed_tokens = cached
        request.status = RequestStatus.RUNNING
        return num_new


def mean_first_token_s(prompts: list[tuple[int, int]], chunk: int, decode_tokens: int, step_seconds: StepSeconds) -> float:
    """The mean seconds to the first tokens of ``prompts`` ((tokens to prefill, tokens before them), in the order
    they are scheduled) prefilled ``chunk`` tokens a step beside ``decode_tokens`` decodes, and beside the decodes of
    the prompts already done, each step taking ``step_seconds(tokens, attended keys)``. The decodes' keys are left
    out: they are alike whatever the chunk."""
    queue = collections.deque(prompts)
    clock = total = 0.0
    decoding = decode_tokens
    while queue:
        room, keys, done = chunk, 0.0, 0
        while queue and room:
            left, before = queue[0]
            take = min(left, room)
            keys += take * (before + (take + 1) / 2)
            room -= take
            if take == left:
                queue.popleft()
                done += 1
            else:
                queue[0] = (left - take, before + take)
        clock += step_seconds(decoding + chunk - room, keys)
        total += done * clock
        decoding += done
    return total / len(prompts)
