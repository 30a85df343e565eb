"""Which attention path runs which kind of step, decided by timing both on this CPU (``cpu_attention_kernel: auto``).

Two paths attend a step over the paged KV pool (``paged_attention.py``): our CPU kernel, which reads each key and
value in place through the step's slot lists, and torch's, which gathers each sequence's keys and values into a
copy that SDPA then reads (torch's flash-attention CPU kernel, vectorised for whatever ISA torch was built for). Which
is faster depends on the CPU and on the step: a decode step is a few queries over many keys (bound by reading the
pool), a prefill chunk many queries over many keys (bound by arithmetic), and a step can carry both. So at load,
for the model's head layout and KV dtype, both paths attend each kind of step on random keys, through the same
attention function a step calls: ``decode`` (16 sequences of 512 keys, one query each: also what a step verifying
drafts, a few queries a sequence, is classed as), ``prefill`` (a 512-token prompt, whole: each query sees the keys
up to its own, so half the products of the full square are masked) and ``mixed`` (that prompt beside those 16
decodes). The kernel is the incumbent; torch's path replaces it for a kind of step only
where it is faster by the Linear bake-off's margin. The decision is cached
beside the Linear one (``kernel_choice.py``, family ``attention``). With ``engine.batch_invariant`` the kernel runs
every step: it attends a query with the same bits whichever step computes it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from app.cpu import kernel_choice
from app.engine.paged_attention import paged_attention_forward
from app.engine.paged_batch import PagedBatch, SequenceSlice

PHASES = ("decode", "prefill", "mixed")
CHUNK_QUERIES = 16  # a sequence with this many queries in a step is prefilling (fewer: decoding or verifying drafts)
_DECODE_SEQS, _DECODE_KEYS = 16, 512
_PREFILL_QUERIES, _PREFILL_KEYS = 512, 512  # a prompt prefilled whole, the common case (measured, AVX2 EPYC: the
# kernel 4.5 ms, torch 5.6; a 256-query chunk deep in a 1,024-token prompt flips it, 7.7 against 6.1, but served
# long prompts gained nothing from torch's path there: its explicit mask computes the masked half too)
logger = logging.getLogger(__name__)

_REPEATS = 2  # timed passes per path and kind of step (the fastest counts), after one untimed
_CALLS = 3  # attention calls per pass (a step calls it once per layer)


@dataclass
class AttentionRoute:
    """The CPU kernel (None: torch's path for every step) and the kinds of step it attends."""

    kernel: object | None = None
    phases: frozenset[str] = field(default_factory=lambda: frozenset(PHASES))

    def for_step(self, slices: Sequence[SequenceSlice]):
        """The kernel if it attends this kind of step, else None (torch's path)."""
        if self.kernel is None or len(self.phases) == len(PHASES):
            return self.kernel
        return self.kernel if step_kind(slices) in self.phases else None

    def describe(self) -> str:
        if self.kernel is None:
            return "gather + SDPA"
        if self.phases == frozenset(PHASES):
            return "kernel"
        return ", ".join(f"{phase}: {'kernel' if phase in self.phases else 'gather + SDPA'}" for phase in PHASES)


def attention_route(kernel, config, model_config, kv_dtype: torch.dtype) -> AttentionRoute:
    """The engine's route: no kernel, the kernel for every step (``batch_invariant``, or a kernel chosen by name), or
    with ``cpu_attention_kernel: auto`` the timed one (logged where torch's path takes a kind of step)."""
    if kernel is None or config.batch_invariant or config.cpu_attention_kernel == "kernel":
        return AttentionRoute(kernel)
    from app.cpu.build import build_id

    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    route = choose_route(kernel, heads, kv_heads, head_dim, kv_dtype, config.block_size, build_id())
    if len(route.phases) < len(PHASES):
        logger.info("Attention: %s (as timed on this CPU)", route.describe())
    return route


def step_kind(slices: Sequence[SequenceSlice]) -> str:
    chunks = sum(1 for s in slices if s.num_queries >= CHUNK_QUERIES)
    return "decode" if chunks == 0 else ("prefill" if chunks == len(slices) else "mixed")


def choose_route(kernel, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int,
                 kernel_build: str | None, cache: kernel_choice.ChoiceCache | None = None) -> AttentionRoute:
    """The timed (or cached) route for this head layout: the kernel for the kinds of step it wins or ties."""
    key = f"{num_heads}x{num_kv_heads}x{head_dim} kv {str(kv_dtype).removeprefix('torch.')} block {block_size}"
    timer = lambda _: time_paths(kernel, num_heads, num_kv_heads, head_dim, kv_dtype, block_size)  # noqa: E731
    usable = lambda entry: entry is not None and set(entry.get("choice", {})) == set(PHASES)  # noqa: E731
    choice = kernel_choice.choose_timed([key], timer, "kernel", "attention", kernel_build, usable, cache, "Attention paths")[key]
    return AttentionRoute(kernel, frozenset(phase for phase, path in choice.items() if path == "kernel"))


def time_paths(kernel, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
               block_size: int) -> dict[str, dict[str, float]]:
    """Seconds per attention call of each path (``kernel``, ``torch``) for each phase, on random keys and values."""
    generator = torch.Generator().manual_seed(0)
    steps = {"decode": [SequenceSlice(i, 1, _DECODE_KEYS - 1, []) for i in range(_DECODE_SEQS)],
             "prefill": [SequenceSlice(0, _PREFILL_QUERIES, _PREFILL_KEYS - _PREFILL_QUERIES, [])],
             "mixed": [SequenceSlice(0, _PREFILL_QUERIES, _PREFILL_KEYS - _PREFILL_QUERIES, [])]
             + [SequenceSlice(_PREFILL_QUERIES + i, 1, _DECODE_KEYS - 1, []) for i in range(_DECODE_SEQS)]}
    blocks_per_seq = math.ceil(max(_DECODE_KEYS, _PREFILL_KEYS) / block_size)
    next_block = 0
    for slices in steps.values():
        for s in slices:
            s.block_table = list(range(next_block, next_block + blocks_per_seq))
            next_block += blocks_per_seq
    kv_pool = torch.randn(1, 2, next_block * block_size, num_kv_heads, head_dim, generator=generator).to(kv_dtype)
    layer = _Layer()
    times: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for phase, slices in steps.items():
            tokens = sum(s.num_queries for s in slices)
            query = torch.randn(1, num_heads, tokens, head_dim, generator=generator)
            new = torch.randn(1, num_kv_heads, tokens, head_dim, generator=generator)
            batches = {"kernel": PagedBatch.build(kv_pool, block_size, slices, kernel),
                       "torch": PagedBatch.build(kv_pool, block_size, slices, None)}
            best = dict.fromkeys(batches, math.inf)
            for attempt in range(_REPEATS + 1):
                for path, batch in batches.items():
                    started = time.perf_counter()
                    for _ in range(_CALLS):
                        paged_attention_forward(layer, query, new, new, None, head_dim ** -0.5, paged_batch=batch)
                    if attempt:  # the first pass builds the masks and warms caches
                        best[path] = min(best[path], (time.perf_counter() - started) / _CALLS)
            times[phase] = best
    return times


class _Layer:
    """What the attention function reads off a transformers attention module."""

    layer_idx = 0
