"""Which attention path runs which part of a step, decided by timing both on this CPU (``cpu_attention_kernel: auto``).

Our CPU kernel reads each key and value in place through the step's slot lists and attends every query the same
way, so it leads where reading the pool dominates (decode steps); torch's SDPA has a flash-attention CPU kernel
that tiles queries against keys, which can lead on a long prompt chunk. So at load, for the model's head layout and
KV dtype, two choices are timed on random keys through the same attention function a step calls: ``decode`` (a
decode-only step of 16 sequences of 512 keys: the kernel or gather + SDPA) and ``prompt`` (a step holding a whole
1,024-token prompt and a 512-token chunk over 2,048 keys: the kernel, or SDPA for both, the first by its causal path
over the step's own keys, no gather and no mask, the second over keys gathered from the pool under a causal mask;
with it, every prompt chunk of at least ``SDPA_PROMPT_MIN`` tokens in any step goes to SDPA and the step's other
queries stay on the kernel). The kernel is the incumbent; the other path replaces it only where it is faster
by the Linear bake-off's margin. The decision is cached beside the Linear one (``kernel_choice.py``, family
:data:`FAMILY`). With ``engine.batch_invariant`` the kernel attends everything: a query gets the same bits
whichever step computes it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from app.cpu import kernel_choice
from app.cpu.build import build_id
from app.engine.paged_attention import paged_attention_forward
from app.engine.paged_batch import SDPA_PROMPT_MIN, PagedBatch, SequenceSlice

logger = logging.getLogger(__name__)

PHASES = ("decode", "prompt")
_DECODE_SEQS, _DECODE_KEYS = 16, 512
# SDPA's lead grows with the prompt, so the timed prompt is a long one: at half these lengths the two can tie where a
# 1,666-token prompt runs 1.3x faster on SDPA (docs/performance.md, Kernel choice)
_PROMPT, _CHUNK, _CHUNK_KEYS = 1024, 512, 2048
# the cache's family names what is timed: a change to it measures again instead of reading an older decision
FAMILY = f"attention: decode {_DECODE_SEQS}x{_DECODE_KEYS} keys, prompt {_PROMPT} + {_CHUNK} over {_CHUNK_KEYS}"
_REPEATS = 2  # timed passes per path and kind of step (the fastest counts), after one untimed
# attention calls per pass (a step calls it once per layer): a long prompt's call lasts long enough to time alone
_CALLS = {"decode": 3, "prompt": 1}


@dataclass
class AttentionRoute:
    """The CPU kernel (None: torch's path for every step) and the parts of a step it attends."""

    kernel: object | None = None
    phases: frozenset[str] = field(default_factory=lambda: frozenset(PHASES))
    prompt_min: int = SDPA_PROMPT_MIN  # the load-time parity check lowers it, so its short prompts take SDPA's path too

    def batch(self, kv_pool: torch.Tensor, block_size: int, slices: Sequence[SequenceSlice]) -> PagedBatch:
        """The step's metadata for this route."""
        decode_only = all(s.num_queries == 1 for s in slices)
        kernel = self.kernel if "decode" in self.phases or not decode_only else None
        return PagedBatch.build(kv_pool, block_size, slices, kernel, "prompt" not in self.phases, self.prompt_min)

    def describe(self) -> str:
        if self.kernel is None:
            return "gather + SDPA"
        if self.phases == frozenset(PHASES):
            return "kernel"
        return (f"decode steps: {'kernel' if 'decode' in self.phases else 'gather + SDPA'}, prompt chunks of "
                f"{self.prompt_min}+ tokens: {'kernel' if 'prompt' in self.phases else 'SDPA'}, the rest: kernel")


def attention_route(kernel, config, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> AttentionRoute:
    """The engine's route: no kernel, the kernel for everything (``batch_invariant``, or ``cpu_attention_kernel:
    kernel``), or with ``auto`` the one timed for this head layout (logged where SDPA takes a part)."""
    if kernel is None or config.batch_invariant or config.cpu_attention_kernel == "kernel":
        return AttentionRoute(kernel)
    route = choose_route(kernel, num_heads, num_kv_heads, head_dim, kv_dtype, config.block_size, build_id())
    if len(route.phases) < len(PHASES):
        logger.info("Attention: %s (as timed on this CPU)", route.describe())
    return route


def choose_route(kernel, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int,
                 kernel_build: str | None, cache: kernel_choice.ChoiceCache | None = None) -> AttentionRoute:
    """The timed (or cached) route for this head layout: the kernel for the kinds of step it wins or ties."""
    key = f"{num_heads}x{num_kv_heads}x{head_dim} kv {str(kv_dtype).removeprefix('torch.')} block {block_size}"
    timer = lambda _: time_paths(kernel, num_heads, num_kv_heads, head_dim, kv_dtype, block_size)  # noqa: E731
    usable = lambda entry: entry is not None and set(entry.get("choice", {})) == set(PHASES)  # noqa: E731
    choice = kernel_choice.choose_timed([key], timer, "kernel", FAMILY, kernel_build, usable, cache, "Attention paths")[key]
    return AttentionRoute(kernel, frozenset(phase for phase, path in choice.items() if path == "kernel"))


def time_paths(kernel, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
               block_size: int) -> dict[str, dict[str, float]]:
    """Seconds per attention call of each path for each choice, on random keys and values: ``decode`` (``kernel``,
    ``torch``: gather + SDPA) and ``prompt`` (``kernel``, ``torch``: SDPA for the prompt chunks)."""
    generator = torch.Generator().manual_seed(0)
    decode = [SequenceSlice(i, 1, _DECODE_KEYS - 1, []) for i in range(_DECODE_SEQS)]
    prompt = [SequenceSlice(0, _PROMPT, 0, []), SequenceSlice(_PROMPT, _CHUNK, _CHUNK_KEYS - _CHUNK, [])]
    blocks_per_seq = math.ceil(max(_DECODE_KEYS, _PROMPT, _CHUNK_KEYS) / block_size)
    for index, s in enumerate(decode + prompt):
        s.block_table = list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq))
    slots = (len(decode) + len(prompt)) * blocks_per_seq * block_size
    kv_pool = torch.randn(1, 2, slots, num_kv_heads, head_dim, generator=generator).to(kv_dtype)
    routes = {"decode": (decode, {"kernel": PagedBatch.build(kv_pool, block_size, decode, kernel),
                                  "torch": PagedBatch.build(kv_pool, block_size, decode, None)}),
              "prompt": (prompt, {"kernel": PagedBatch.build(kv_pool, block_size, prompt, kernel),
                                  "torch": PagedBatch.build(kv_pool, block_size, prompt, kernel, sdpa_prompts=True)})}
    times: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for phase, (slices, batches) in routes.items():
            tokens = sum(s.num_queries for s in slices)
            query = torch.randn(1, num_heads, tokens, head_dim, generator=generator)
            new = torch.randn(1, num_kv_heads, tokens, head_dim, generator=generator)
            best = dict.fromkeys(batches, math.inf)
            for attempt in range(_REPEATS + 1):
                for path, batch in batches.items():
                    started = time.perf_counter()
                    for _ in range(_CALLS[phase]):
                        paged_attention_forward(_Layer(), query, new, new, None, head_dim ** -0.5, paged_batch=batch)
                    if attempt:  # the first pass builds the masks and warms caches
                        best[path] = min(best[path], (time.perf_counter() - started) / _CALLS[phase])
            times[phase] = best
    return times


class _Layer:
    """What the attention function reads off a transformers attention module."""

    layer_idx = 0
