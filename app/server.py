"""One served model, assembled: load weights, prove they run, start the engine, serve OpenAI calls.

The Ray Serve replica deployment is a thin shell around this class, so everything here is
testable without a cluster.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from app.api.serving import OpenAIServing
from app.api.tools import tool_parser_for
from app.config import ServedModelConfig
from app.config.engine import listed_cpus
from app.engine import AsyncEngine, Request, SamplingParams, build_engine_core
from app.engine.async_engine import Admit
from app.engine.draft_calls import DraftClient
from app.engine.errors import RequestFailedError
from app.engine.host_memory import back_with_huge_pages, keep_freed_memory, tensor_spans
from app.engine.core_process import CoreInfo, ProcessCore, ThreadCore
from app.spec.remote import DraftCall, DraftResult, draft_sampling

if TYPE_CHECKING:  # loading a model needs torch and transformers; a replica that hosts no model never imports them
    from app.engine.engine import LLMEngine
    from app.models import LoadedModel

logger = logging.getLogger(__name__)

WARMUP_PROMPT = "Hello"

# Builds a served model's engine core and says what it loaded; build_model_core (below) is the real one.
CoreBuilder = Callable[[ServedModelConfig], tuple[Any, CoreInfo]]


class ModelServer:
    def __init__(
        self,
        config: ServedModelConfig,
        admit: Admit | None = None,
        build_core: CoreBuilder | None = None,
        draft_client: DraftClient | None = None,
    ) -> None:
        """``build_core`` (default: load the configured model) lets serving tests run all of this on a fake model;
        ``draft_client`` sends draft calls to the draft model of a ``drafter: model`` (the deployment's handle)."""
        self.config = config
        started = time.monotonic()
        build = functools.partial(build_core or build_model_core, config)
        # Returns once the core has loaded and warmed up, in its own process or on an engine thread of this one.
        host = (ProcessCore if config.engine.separate_process else ThreadCore)(build)
        self.info = host.info
        self.engine = AsyncEngine(host, draft_client=draft_client, **_front_options(config))
        self.serving = OpenAIServing(
            self.engine,
            self.info.tokenizer,
            self.info.name,
            self.info.max_model_len,
            self.info.eos_token_ids,
            vocab_size=self.info.vocab_size,
            default_sampling=_sampling_defaults(self.info, config),
            admit=admit,
            speculative_names=[spec.served_name for spec in config.engine.drafters],
            tool_parser=tool_parser_for(config.model.tool_parser, self.info.tokenizer),
            reasoning_parser=config.model.reasoning_parser,
        )
        self.ready_s = time.monotonic() - started
        logger.info("model %s ready in %.1fs (warm-up %.2fs; tool calls read as %s)", self.info.name, self.ready_s,
                    self.info.warmup_s, self.serving.tool_parser)

    @property
    def name(self) -> str:
        return self.info.name

    def model_card(self, name: str | None = None) -> dict:
        """What /v1/models lists for ``name`` (the model's own name by default, or its speculative twin's)."""
        return {
            "id": name or self.info.name,
            "object": "model",
            "created": int(self.engine.started_at),
            "owned_by": "llm-serve",
            "root": self.config.model.source,
            "max_model_len": self.info.max_model_len,
        }

    def metrics(self) -> dict[str, dict]:
        """For GET /metrics: per served name, its requests' metrics; the engine's counters under the model's own name,
        each drafter's speculation counters under the name it serves (the model's own for an unnamed drafter)."""
        own, *_ = names = self.config.served_names
        result = {name: {"requests": self.serving.metrics[name].to_dict() if name in self.serving.metrics else {}} for name in names}
        engine = self.engine.stats()
        by_drafter = engine.pop("spec_by_name", None) or {}
        result[own]["engine"] = {key: value for key, value in engine.items() if not key.startswith("spec_")}
        for name, counters in by_drafter.items():
            result[name or own].setdefault("engine", {}).update({f"spec_{key}": value for key, value in counters.items()})
        return result

    async def propose(self, call: DraftCall) -> DraftResult:
        """Draft for another model's sequence (this model is its ``drafter: model``): ``call.num_tokens`` tokens
        after the call's context, computed in this engine's batches (greedy for a greedy request, else sampled,
        each with the distribution it was drawn from: app/spec/remote.py)."""
        room = self.info.max_model_len - len(call.prompt_token_ids) - len(call.output_token_ids)
        num_tokens = min(call.num_tokens, room)
        if num_tokens <= 0:
            return DraftResult(call.call_id, call.drafter, call.sequence_id, [])
        sampling = draft_sampling(call.sampling, len(call.output_token_ids), num_tokens)
        request = Request(f"draft-{call.sequence_id}-{call.call_id}-{uuid.uuid4().hex[:8]}", list(call.prompt_token_ids),
                          sampling, self.info.eos_token_ids, output_token_ids=list(call.output_token_ids),
                          drafter=None, detokenize=False, session_id=call.sequence_id, cache_salt=call.cache_salt)
        tokens: list[int] = []
        probs: list = []
        first_s = last_s = 0.0
        try:
            async for output in self.engine.generate(request, self.serving.admit):
                last_s = time.monotonic()
                first_s = first_s or last_s
                tokens.extend(output.new_token_ids)
                probs.extend(lp.sampled_from if lp is not None else None for lp in output.logprobs or [])
        except RequestFailedError as exc:  # this draft's own (its bans, its format past a stop it does not see): not
            # the replica's, whose failures pause drafting for every sequence; what it drafted still helps
            logger.info("draft request %s ended after %d token(s): %s", request.request_id, len(tokens), exc)
        # the drafting cost per token, past the first (which also paid the context's prefill and any queue)
        s_per_token = (last_s - first_s) / (len(tokens) - 1) if len(tokens) > 1 else None
        sampled = len(probs) == len(tokens) and all(p is not None for p in probs)
        return DraftResult(call.call_id, call.drafter, call.sequence_id, tokens, s_per_token=s_per_token,
                           probs=probs if sampled and tokens else None)

    def check_health(self) -> None:
        """Raise if this replica can no longer serve: the engine loop died, or it is wedged (no step
        completed within ``engine.step_timeout_s`` while requests wait)."""
        if not self.engine.is_healthy():
            raise RuntimeError(f"engine of {self.name} is not healthy: {self.engine.dead_reason}")

    @property
    def healthy(self) -> bool:
        """The engine runs and steps: what ``check_health`` checks, as a value."""
        return self.engine.is_healthy()

    @property
    def ready(self) -> bool:
        """Takes requests: warmed up (the constructor returned after a real generation), healthy, not draining."""
        return self.healthy and not self.engine.draining

    async def drain(self, timeout_s: float) -> int:
        """Admit nothing more, let the requests in flight finish within ``timeout_s``, end the rest with an error."""
        return await self.engine.drain(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.engine.shutdown(timeout_s)


def _front_options(config: ServedModelConfig) -> dict:
    return {
        # all a replica holds: its running batch and the requests waiting for a place in it
        "max_queued_requests": config.engine.max_num_seqs + config.engine.max_queued_requests,
        "stream_interval_s": config.engine.stream_interval_ms / 1000,
        "max_stream_chunks_per_s": config.engine.max_stream_chunks_per_s,
        "max_queue_time_s": config.engine.max_queue_time_s,
        "step_timeout_s": config.engine.step_timeout_s,
    }


def build_model_core(config: ServedModelConfig) -> tuple[LLMEngine, CoreInfo]:
    """Load the model, build its engine core and prove it generates (wherever the core will run)."""
    from app.models import load_model

    listed = listed_cpus(config.engine.cpu_threads_bind)
    _set_torch_threads(config.engine.torch_threads or len(listed or ()))
    keep_freed_memory()
    loaded = load_model(config.model)
    core = build_engine_core(loaded, config.engine)
    _weights_and_kv_in_huge_pages(loaded, core)
    if config.engine.parity_check:  # served exactly as transformers computes it, or not at all
        from app.engine.parity import check_parity

        check_parity(core, loaded)
    # Readiness means the model has produced a token, not merely that weights were read.
    warmup_s = _warm_up(core, loaded, config.engine.max_num_batched_tokens)
    from app.engine.parity import architecture, check_attended

    check_attended(core.runner, architecture(loaded.model), loaded.max_model_len)  # the warm-up's step took the paged path
    _bind_threads(config.engine.cpu_threads_bind, loaded.device.type)
    info = CoreInfo(loaded.name, loaded.tokenizer, loaded.max_model_len, loaded.eos_token_ids, loaded.vocab_size, warmup_s,
                    loaded.sampling_defaults)
    return core, info


def _weights_and_kv_in_huge_pages(loaded: LoadedModel, core: LLMEngine) -> None:
    """What every decode step streams, the weights and the KV cache, in 2 MB pages where the kernel allows it."""
    model = loaded.model
    spans = tensor_spans([*model.parameters(), *model.buffers(), core.runner.kv_pool])
    total, started = sum(size for _, size in spans), time.monotonic()
    gained, why = back_with_huge_pages(spans)
    logger.info("host memory: %.0f of %.0f MB of weights and KV cache in 2 MB pages (%.1f s)%s", gained / 2**20, total / 2**20,
                time.monotonic() - started, f"; the rest in 4 KB pages: {why}" if why else "")


def _sampling_defaults(info: CoreInfo, config: ServedModelConfig) -> dict:
    """For fields a request leaves unset: the config's ``default_sampling``, then the checkpoint's, then OpenAI's."""
    from_checkpoint = {key: value for key, value in info.sampling_defaults.items() if key not in config.default_sampling}
    if from_checkpoint:
        logger.info("model %s: requests that leave them unset take its generation_config's %s (model.generation_config: "
                    "none or default_sampling to change)", info.name,
                    ", ".join(f"{key}={value}" for key, value in from_checkpoint.items()))
    return {**info.sampling_defaults, **config.default_sampling}


def _warm_up(core, loaded: LoadedModel, step_tokens: int) -> float:
    """Generate two tokens synchronously through the real engine path (raise if it fails), one under a grammar, then
    one step at the full token budget: the largest activations the engine allocates, whose memory the process then keeps
    (``keep_freed_memory``), so the first burst of requests does not pay for fresh pages."""
    started = time.monotonic()
    prompt = loaded.tokenizer.encode(WARMUP_PROMPT) or [0]
    _generate(core, loaded, Request("warmup", prompt, _warm_up_sampling(2), loaded.eos_token_ids))
    _warm_up_grammars(core, loaded, prompt)
    length = max(1, min(step_tokens, loaded.max_model_len - 1))
    full_step = (prompt * (length // len(prompt) + 1))[:length]
    _generate(core, loaded, Request("warmup-full-step", full_step, _warm_up_sampling(1), loaded.eos_token_ids))
    _say_if_capped(core, loaded.name, step_tokens)
    return time.monotonic() - started


def _say_if_capped(core, name: str, step_tokens: int) -> None:
    """A full-budget step that ran out of memory beside the KV cache left the engine capping its steps (it serves,
    retrying the full size now and then): say so at start, with the settings that end it."""
    cap = core.stats().get("step_token_cap", step_tokens)
    if cap < step_tokens:
        logger.warning("model %s: a step of %d tokens did not fit beside the KV cache; steps carry at most %d tokens "
                       "(llm_serve:engine_step_token_cap), and the larger size is tried again now and then. Lower "
                       "engine.kv_cache_memory_mb (0: 80%% of the GPU memory free after loading) or set "
                       "engine.max_num_batched_tokens to %d", name, step_tokens, cap, cap)


def _warm_up_grammars(core, loaded: LoadedModel, prompt: list[int]) -> None:
    """One token under a grammar: the vocabulary as the grammar engine reads it (~0.4 s to build) is made now, not
    inside the first structured-output request's step, where every stream would wait for it."""
    from app.api.structured import compiled

    sampling = SamplingParams(max_tokens=1, temperature=0, grammar=compiled("json", '{"type": "object"}', "warm-up"))
    try:
        _generate(core, loaded, Request("warmup-grammar", prompt, sampling, loaded.eos_token_ids))
    except RuntimeError as exc:  # the model still serves: its constrained requests are refused, each saying why
        logger.warning("model %s: structured outputs and forced tool calls cannot run: %s", loaded.name, exc)


def _warm_up_sampling(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


def _generate(core, loaded: LoadedModel, request: Request) -> None:
    core.add_requests([request])
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    if not outputs or outputs[-1].finish_reason != "length":
        error = (outputs[-1].error if outputs else None) or "no output"
        if "OutOfMemoryError" in error:  # the KV pool was sized before any step ran: what a step needs was a guess
            error += (" (a step at the full token budget did not fit beside the KV cache: lower engine.kv_cache_memory_mb"
                      " (0: 80% of the GPU memory free after loading) or engine.max_num_batched_tokens)")
        raise RuntimeError(f"warm-up generation of {loaded.name} failed: {error}")


def _bind_threads(setting: str, device_type: str) -> None:
    """The thread that will run every step keeps its OpenMP team one thread per CPU (app/cpu/threads.py)."""
    import torch

    from app.cpu.threads import bind_engine_threads

    threads = torch.get_num_threads()
    logger.info("engine threads: %d, %s", threads, bind_engine_threads(setting, threads, device_type))


def _set_torch_threads(requested: int) -> None:
    # Ray sets OMP_NUM_THREADS to the actor's num_cpus (often 1); a replica that owns the machine's cores should use
    # them all unless told otherwise, and no more than its container's CPU limit allows (app/engine/host_cpus.py).
    import torch

    from app.engine.host_cpus import usable_cpus

    threads = requested or usable_cpus()
    torch.set_num_threads(threads)
