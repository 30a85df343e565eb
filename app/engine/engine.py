"""The engine core: one step is schedule -> run -> process outputs.

The same core serves every batching mode; the mode only changes the scheduler's policy
(``none``: one sequence at a time; ``dynamic``: a group runs to completion before the next is
admitted; ``continuous``: admit whenever there is room). With speculative decoding on
(``engine.speculative``), each step also verifies the drafts proposed after the previous one, and a
request may emit several tokens a step. Driven from a single thread by ``AsyncEngine``; not
thread-safe by itself.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from dataclasses import dataclass, field

import torch

from app.config import EngineConfig
from app.engine.grammar import consume
from app.engine.kv_cache import BlockManager
from app.engine.output_processor import OutputProcessor
from app.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from app.engine.runner import ModelRunner, RunnerOutput
from app.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from app.engine.step_budget import StepCost, StepTokenCap, attended_keys
from app.engine.text_config import text_config
from app.metrics import STEP_TOKEN_BUCKETS, Histogram
from app.models import LoadedModel
from app.spec.controller import SpeculationController

logger = logging.getLogger(__name__)
# A device-side assert or an illegal memory access (torch.AcceleratorError) leaves the CUDA context unusable;
# out of memory (torch.OutOfMemoryError) does not, and fails only its step.
_DEVICE_LOST = getattr(torch, "AcceleratorError", ())


def _out_of_memory(exc: BaseException) -> bool:
    """A GPU's out of memory, Python's, or torch's CPU allocator's (a RuntimeError saying so)."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


@dataclass
class PassError:
    """Why a forward pass failed: the exception's text only (its traceback would keep the pass's tensors alive while
    the step's parts run), and whether it ran out of memory (a smaller pass may fit)."""

    text: str
    out_of_memory: bool


@dataclass
class StepCounters:
    num_steps: int = 0
    num_steps_run_apart: int = 0  # steps whose forward pass raised, run again in parts (``_execute_apart``)
    num_batched_tokens: int = 0  # over all steps
    num_generated_tokens: int = 0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    busy_s: float = 0.0  # wall time spent in steps
    step_tokens: Histogram = field(default_factory=lambda: Histogram(STEP_TOKEN_BUCKETS))  # tokens per step


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.max_model_len = loaded.max_model_len
        self.runner = ModelRunner(loaded, config)
        if self.runner.num_token_slots < loaded.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.runner.num_token_slots} tokens, fewer than one sequence of "
                f"max_model_len={loaded.max_model_len}; raise engine.kv_cache_memory_mb (or num_kv_blocks) "
                "or lower model.max_model_len"
            )
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   max_parked=config.max_num_seqs)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            gang=config.batching == "dynamic",
            sliding_window=self.runner.sliding_window,
        )
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.outputs = OutputProcessor(loaded.tokenizer, loaded.max_model_len)
        vocab_size = text_config(self.runner.model.config).vocab_size
        self.speculation = SpeculationController(config.drafters, loaded.max_model_len, vocab_size) if config.drafters else None
        self.counters = StepCounters()
        self.step_cost = StepCost()
        self.token_cap = StepTokenCap(config.max_num_batched_tokens)
        self._groups = itertools.count()
        self._refused: list[RequestOutput] = []  # requests that failed at admission, reported by the next step
        self._stalled_at: tuple[int, int] | None = None  # (waiting, running) when a step last had nothing to run

    # ---- the core contract driven by AsyncEngine ---------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        """Admit requests as one group (one batcher window): dynamic batching starts and ends them together."""
        group = next(self._groups)
        for request in requests:
            request.group = group
            try:
                self._require_room(request)
                self.runner.admit(request)
            except Exception as exc:  # noqa: BLE001 - this request's failure alone; the group goes on without it
                logger.exception("request %s failed at admission", request.request_id)
                self.runner.forget(request.request_id)  # what admission made before it failed (a seeded generator)
                self._refused.append(self._fail_one(request, exc))
                continue
            self.scheduler.add_request(request)

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def _require_room(self, request: Request) -> None:
        """A request must leave room for a token within the context: one that cannot would wait for blocks
        forever (the API refuses it first, with a 400; this holds for every other caller)."""
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"{request.num_tokens} tokens leave no room to generate within max_model_len={self.max_model_len}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.remove_request(request_id)
        if request is None:
            return None
        self.runner.forget(request_id)
        if self.speculation is not None:
            self.speculation.forget(request_id)
        return self.outputs.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._refused) or self.scheduler.has_unfinished_requests()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.speculation is not None:
            self.speculation.expire(self.scheduler.running, time.monotonic())
        refused, self._refused = self._refused, []
        scheduled = self.scheduler.schedule(self._decode_step_tokens(), self.token_cap.cap, self.step_cost.seconds)
        self._stalled_at = None if scheduled.scheduled else (len(self.scheduler.waiting), len(self.scheduler.running))
        if not scheduled.scheduled:
            return refused
        keys = attended_keys(scheduled)  # read before the update advances the requests' positions
        executed = time.perf_counter()
        result, error = self._execute(scheduled.scheduled, whole_step=True)
        failed, retried, apart = [], [], error is not None
        if apart:  # after the except block: the failed pass's tensors are freed before its parts run (out of memory)
            result, failed = self._execute_apart(scheduled.scheduled, error)
            failed, retried = self._after_out_of_memory(scheduled, error, failed)
            self.counters.num_steps_run_apart += 1
        else:
            self.token_cap.fitted()
        outputs = refused + [self._fail_one(request, why.text) for request, why in failed]
        for request, _ in failed:  # their KV released, their streams ended with the error
            self._release(request)
        if failed or retried:  # the rest go on as if nothing happened; a retried request's next step starts where this one did
            gone = {request.request_id for request in [*(r for r, _ in failed), *retried]}
            scheduled = SchedulerOutput([s for s in scheduled.scheduled if s.request.request_id not in gone], scheduled.preempted)
        if self.speculation is not None and _only_decodes(scheduled) and not apart:
            self.speculation.observe_step(scheduled.num_batched_tokens, time.perf_counter() - executed)
        self.scheduler.update(scheduled, {r.request_id: n for r, n in zip(result.requests, result.num_accepted)})
        for request, token_ids, logprobs, drafted, accepted, error in zip(
            result.requests, result.token_ids, result.logprobs, result.num_drafted, result.num_accepted, result.errors
        ):
            if error is None:
                output = self._emit(request, token_ids, logprobs, drafted, accepted)
            else:
                output = self._fail_one(request, error)
            if output.finished:
                self._release(request)
            outputs.append(output)
        self._count(scheduled, sum(len(o.new_token_ids) for o in outputs))
        took = time.perf_counter() - started
        if not apart:  # a step run apart took no normal step's time
            self.step_cost.observe(scheduled.num_batched_tokens, took, keys)
        self.counters.busy_s += took
        if self.speculation is not None:
            for request, exc in self.speculation.propose(self._decoding(), self._mean_step_s(), time.monotonic()):
                logger.error("request %s failed while drafting: %s: %s", request.request_id, type(exc).__name__, exc)
                outputs.append(self._fail_one(request, exc))
                self._release(request)
        return outputs

    # ---- drafts computed elsewhere (engine.speculative drafter: model) ----------------------------
    def take_draft_calls(self) -> list:
        """The draft calls this engine wants sent (app/spec/remote.py); the serving side sends them."""
        return self.speculation.take_calls() if self.speculation is not None else []

    def add_draft_results(self, results: list) -> None:
        if self.speculation is not None:
            self.speculation.add_results(results, self.scheduler.running, self._mean_step_s(), time.monotonic())

    def idle_wait_s(self) -> float:
        """How long the driver may wait for a command before the next step: 0 while a step has work; while every
        running sequence waits for drafts, and no waiting request can be admitted (none waits, or a step admitted none
        since the last request came or went: no slot or no blocks, which only a command or a draft's deadline frees),
        until the first stops waiting."""
        if self.speculation is None or not self.scheduler.running:
            return 0.0
        if self.scheduler.waiting and self._stalled_at != (len(self.scheduler.waiting), len(self.scheduler.running)):
            return 0.0
        if any(not r.awaiting_draft for r in self.scheduler.running):
            return 0.0
        deadline = self.speculation.next_deadline(self.scheduler.running)
        return 0.0 if deadline is None else max(0.0, deadline - time.monotonic())

    # ---- statistics --------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        c = self.counters
        prefix = self.blocks.prefix_stats
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_parked": self.blocks.num_parked_blocks,  # sessions' KV kept for their next request (reclaimable)
            "kv_usage": self.blocks.num_used_blocks / self.blocks.num_blocks,
            "prefix_cache_queried_tokens": prefix.queried_tokens,
            "prefix_cache_hit_tokens": prefix.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": c.num_steps,
            "num_steps_run_apart": c.num_steps_run_apart,
            "step_token_cap": self.token_cap.tokens,  # max_num_batched_tokens, lower after a step ran out of memory
            "num_generated_tokens": c.num_generated_tokens,
            "last_step_tokens": c.last_step_tokens,
            "last_step_seqs": c.last_step_seqs,
            "mean_tokens_per_step": c.num_batched_tokens / c.num_steps if c.num_steps else 0.0,
            "mean_step_ms": 1000 * c.busy_s / c.num_steps if c.num_steps else 0.0,
            "step_tokens": c.step_tokens.to_dict(),
            **({f"spec_{k}": v for k, v in self.speculation.stats.to_dict().items()} if self.speculation else {}),
            **({"spec_by_name": self.speculation.stats_by_name()} if self.speculation else {}),
        }

    # ---- internals ---------------------------------------------------------------------------
    def _emit(self, request: Request, token_ids: list[int], logprobs: list, drafted: int, accepted: int) -> RequestOutput:
        """A request's tokens of this step through stop matching and detokenizing; an exception there (its stop
        strings, its text) fails this request alone."""
        try:
            if self.speculation is not None:
                self.speculation.record(request, drafted, accepted)
            return self._append(request, token_ids, logprobs)
        except Exception as exc:  # noqa: BLE001 - the step goes on for the others
            logger.exception("request %s failed while its tokens were processed", request.request_id)
            return self._fail_one(request, exc)

    def _fail_one(self, request: Request, error: BaseException | str) -> RequestOutput:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return self.outputs.finish(request, RequestStatus.FAILED, text)

    def _append(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Append a step's tokens in order until the request finishes; one output carries them all."""
        if request.spec_token_ids:
            request.set_drafts([])  # verified: the next drafts come from the controller
        output = None
        for token_id, logprob in zip(token_ids, logprobs):
            consume(request, token_id)
            step = self.outputs.append_token(request, token_id, logprob)
            output = step if output is None else output.followed_by(step)
            if step.finished:
                break  # what was drafted past a stop is dropped, as if never generated
        return output

    def _decode_step_tokens(self) -> int | None:
        """The most tokens a step carrying decodes may hold (engine.max_decode_step_ms; None: no bound)."""
        if not self.config.max_decode_step_ms:
            return None
        deepest = max((r.num_computed_tokens for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens > 1), default=0)
        return self.step_cost.tokens_within_bound(self.config.max_decode_step_ms / 1000, deepest)

    def _mean_step_s(self) -> float:
        c = self.counters
        return c.busy_s / c.num_steps if c.num_steps else 0.0

    def _decoding(self) -> list[Request]:
        """Running requests whose next step decodes one token (so it may verify drafts too)."""
        return [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]

    def _release(self, request: Request) -> None:
        completed = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        self.scheduler.remove_request(request.request_id, park=completed)  # a session's KV waits for its next request
        self.runner.forget(request.request_id)
        if self.speculation is not None:
            self.speculation.forget(request.request_id)

    def _after_out_of_memory(self, scheduled: SchedulerOutput, error: PassError,
                             failed: list[tuple[Request, PassError]]) -> tuple[list[tuple[Request, PassError]], list[Request]]:
        """A step that ran out of memory caps the tokens of the steps after it; a request that ran out of memory alone
        on a chunk of several tokens is not failed but retried from where it was, in the smaller chunks the cap makes
        (a single token that does not fit fails). Returns (what fails, what is retried)."""
        if error.out_of_memory:
            self.token_cap.shrink(scheduled.num_batched_tokens)
        chunks = {item.request.request_id: item.num_new_tokens for item in scheduled.scheduled}
        retried = [request for request, why in failed if why.out_of_memory and chunks[request.request_id] > 1]
        for request in retried:
            self.token_cap.shrink(chunks[request.request_id])
        if error.out_of_memory or retried:
            logger.warning("out of memory in a step of %d tokens: steps carry at most %d tokens from now on "
                           "(engine.max_num_batched_tokens: %d; doubled back every %d steps that fit)",
                           scheduled.num_batched_tokens, self.token_cap.tokens, self.token_cap.limit, StepTokenCap.REGROW_STEPS)
        kept = {request.request_id for request in retried}
        return [(request, why) for request, why in failed if request.request_id not in kept], retried

    def _execute(self, items: list, whole_step: bool = False) -> tuple[RunnerOutput, PassError | None]:
        """One forward pass of ``items``, or why it failed. A whole step's failure is logged with its traceback."""
        try:
            return self.runner.execute(SchedulerOutput(items), self.blocks), None
        except _DEVICE_LOST:
            raise  # the GPU's context is broken for every later step too: the core dies, Serve replaces the replica
        except Exception as exc:  # noqa: BLE001 - the step's requests run apart: only what fails alone fails
            if whole_step:  # the traceback as text: a log record holding it (a handler that keeps records) would not
                logger.error("a step of %d requests failed; running them apart\n%s", len(items), traceback.format_exc())
            return RunnerOutput(), PassError(f"{type(exc).__name__}: {exc}", _out_of_memory(exc))

    def _execute_apart(self, items: list, error: PassError) -> tuple[RunnerOutput, list[tuple[Request, PassError]]]:
        """After a step of ``items`` failed with ``error``: its halves run as steps of their own, and so on down to
        single requests. What failed on a batch-mate (a bad request's shapes) or on the step's size (out of memory)
        completes, with the tokens it gets alone (the KV it wrote is written again, and nothing was sampled: a
        sampling error is one request's already, ``RunnerOutput.errors``); a request failing alone fails."""
        if len(items) == 1:
            logger.error("request %s failed alone: %s", items[0].request.request_id, error.text)
            return RunnerOutput(), [(items[0].request, error)]
        merged, failed = RunnerOutput(), []
        for part in (items[:len(items) // 2], items[len(items) // 2:]):
            result, part_error = self._execute(part)
            part_failed = []
            if part_error is not None:  # halved again
                result, part_failed = self._execute_apart(part, part_error)
            for name in RunnerOutput.__dataclass_fields__:
                getattr(merged, name).extend(getattr(result, name))
            failed += part_failed
        return merged, failed

    def _count(self, scheduled: SchedulerOutput, num_sampled: int) -> None:  # num_sampled: tokens emitted
        c = self.counters
        c.num_steps += 1
        c.last_step_tokens = scheduled.num_batched_tokens
        c.last_step_seqs = len(scheduled.scheduled)
        c.num_batched_tokens += c.last_step_tokens
        c.step_tokens.observe(c.last_step_tokens)
        c.num_generated_tokens += num_sampled


def _only_decodes(scheduled: SchedulerOutput) -> bool:
    """Every sequence computes just its last token (and drafts after it): a step the draft policies can price."""
    return all(item.num_new_tokens - item.num_spec_tokens == 1 and item.samples for item in scheduled.scheduled)
