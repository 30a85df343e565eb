"""Per-step attention metadata for the paged attention function (``paged_attention.py``).

Everything that does not depend on the layer (slots, gather indices, masks) is built once per step here, and
each layer reads it. Two routes read it:

- the CPU kernel (``app/cpu/attention.py``, fp32 queries): a decode-only step as key slots and counts per
  sequence, any other step as one row of key slots per sequence and the number of keys each query sees;
- torch's SDPA over keys gathered from the pool, in at most two padded groups (decodes with one query each,
  and prefill chunks), built on first use (a step on the kernel builds them only if a layer needs torch: one
  with attention logit softcapping);
- on a kernel step with ``sdpa_prompts`` (where SDPA was timed faster on prompts on this CPU), each prompt chunk of
  at least :data:`SDPA_PROMPT_MIN` tokens attends through SDPA (from the prompt's first token: its causal path
  over the step's own keys; deeper: its keys gathered under a causal mask), every other query through the kernel.

Sliding-window layers (``window``: a query at position p sees keys p-window+1 .. p, as transformers' mask)
read a windowed variant, built once per step and window: the torch route masks keys that left the window;
the kernel gets rows that start at each query's window, so it never reads a slot before it (those blocks
may have been handed back to the pool already, ``BlockManager.release_before``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

# A prompt chunk this long may go to SDPA (it tiles the chunk's queries against the keys; shorter chunks gain nothing
# measurable, and most steps' prompts are short)
SDPA_PROMPT_MIN = 256

if TYPE_CHECKING:  # the engine core takes the kernel from the runner; it does not load it
    from app.cpu.attention import PagedAttentionKernel


@dataclass
class SequenceSlice:
    """One request's part of the packed batch (built by the runner from the scheduler output)."""

    query_start: int  # index of its first new token in the packed row
    num_queries: int  # tokens computed this step
    num_computed: int  # tokens already in the cache before this step (the first query's position)
    block_table: Sequence[int]  # negative entries: blocks handed back (wholly before every window)


@dataclass
class AttentionGroup:
    """Requests attended together by SDPA as a padded batch: ``B`` sequences, ``Q`` queries, ``L`` keys."""

    query_index: torch.Tensor  # [B*Q] packed index of each padded query (padding repeats a real one)
    key_slots: torch.Tensor  # [B, L] pool slot of each key (padding: the pool's zero slot, masked out)
    query_pos: torch.Tensor  # [B, Q] position of each query (past the context for padded ones)
    real: torch.Tensor  # [B, Q] True for real queries
    real_rows: torch.Tensor | None  # [n] rows of the flattened [B*Q] output that are real queries (None: all)
    num_seqs: int
    num_queries: int
    whole_prompt: bool = False  # one sequence, every key its own query's (from position 0): plain causal, no mask
    _masks: dict = field(default_factory=dict)  # (repeat, window) -> [B, 1, R*Q, L]

    def folded_mask(self, repeat: int, window: int | None = None) -> torch.Tensor:
        """True where a query may attend a key, for ``repeat`` query heads folded into the query axis:
        [B, 1, R*Q, L] (built once per step and window)."""
        if (repeat, window) not in self._masks:
            key_pos = torch.arange(self.key_slots.shape[1], device=self.key_slots.device)
            # causal within the sequence; keys past its context are padding
            mask = key_pos.view(1, 1, -1) <= self.query_pos.unsqueeze(-1)  # [B, Q, L]
            if window is not None:
                mask &= key_pos.view(1, 1, -1) > (self.query_pos - window).unsqueeze(-1)
            # padded queries see key 0 only (a fully masked row would make SDPA return NaN)
            mask &= self.real.unsqueeze(-1) | (key_pos == 0).view(1, 1, -1)
            b, q, keys = mask.shape
            self._masks[(repeat, window)] = mask.unsqueeze(1).expand(b, repeat, q, keys).reshape(b, 1, repeat * q, keys)
        return self._masks[(repeat, window)]


@dataclass
class KernelDecode:
    """A decode-only step for the CPU kernel: each sequence's key slots and count."""

    key_slots: torch.Tensor  # [B, L] pool slot of each key (the new one too), padded past each count
    key_counts: torch.Tensor  # [B] keys of each sequence


@dataclass
class KernelQueries:
    """Any step's queries for the CPU kernel: each one attended as a decode step attends its one query."""

    key_slots: torch.Tensor  # [S, L] pool slot of each key of each row (padding past its count)
    query_seq: torch.Tensor  # [T] the key_slots row of each packed query
    query_keys: torch.Tensor  # [T] keys each query sees in its row (without a window: its position + 1)


@dataclass
class PromptChunk:
    """A prompt's chunk attended through SDPA: from the prompt's first token, SDPA's causal path over the step's own
    keys; deeper in, its keys gathered from the pool under a causal mask aligned to its last key."""

    query_start: int
    length: int
    key_slots: torch.Tensor | None = None  # [computed + length] pool slot of every key it sees (deeper chunks)
    mask: torch.Tensor | None = None  # [length, computed + length] True where a query sees a key (deeper chunks)


@dataclass
class PagedBatch:
    """Per-step attention metadata. The runner makes one per step; every attention layer reads it and
    records that it did (``attended``: layer index -> the window it attended with), so a layer that took
    another path shows (the load-time parity check looks)."""

    kv_pool: torch.Tensor  # [layers, 2, slots, kv_heads, head_dim], owned by the runner
    block_size: int
    slices: Sequence[SequenceSlice]
    slot_mapping: torch.Tensor  # [T] where each new token's key/value is written
    kernel: PagedAttentionKernel | None = None  # the CPU kernel attends this step (fp32 queries)
    kernel_decode: KernelDecode | None = None  # set for a decode-only step on the kernel
    kernel_queries: KernelQueries | None = None  # set for any other step on the kernel
    prompts: list[PromptChunk] = field(default_factory=list)  # prompt chunks for SDPA
    rest: KernelQueries | None = None  # beside them, the kernel's metadata for the step's other queries,
    rest_rows: torch.Tensor | None = None  # and where those lie in the packed row
    attended: dict[int, int | None] = field(default_factory=dict)
    _groups: list[AttentionGroup] | None = None
    _windowed: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # one query per sequence, in packed order (the steady state): torch attends the queries where they lie
        self.decode_only = all(s.num_queries == 1 for s in self.slices)
        self.null_slot = _null_slot(self.kv_pool)

    @classmethod
    def build(
        cls, kv_pool: torch.Tensor, block_size: int, slices: Sequence[SequenceSlice],
        kernel: PagedAttentionKernel | None = None, sdpa_prompts: bool = False, sdpa_prompt_min: int = SDPA_PROMPT_MIN,
    ) -> "PagedBatch":
        device, null_slot = kv_pool.device, _null_slot(kv_pool)
        if kernel is not None and all(s.num_queries == 1 for s in slices):
            decode, slot_mapping = _kernel_decode(slices, block_size, device)
            return cls(kv_pool, block_size, slices, slot_mapping, kernel, kernel_decode=decode)
        if kernel is not None:
            queries, slot_mapping = _kernel_queries(slices, block_size)
            batch = cls(kv_pool, block_size, slices, slot_mapping, kernel, kernel_queries=queries)
            if sdpa_prompts:
                batch._split_prompt_chunks(sdpa_prompt_min)
            return batch
        slot_mapping = torch.empty(sum(s.num_queries for s in slices), dtype=torch.long)  # filled by _torch_groups
        groups = _torch_groups(slices, block_size, device, slot_mapping, null_slot)
        return cls(kv_pool, block_size, slices, slot_mapping.to(device), _groups=groups)

    def _split_prompt_chunks(self, min_tokens: int) -> None:
        """Prompt chunks of at least ``min_tokens`` queries to SDPA; the kernel's metadata for the rest, their queries
        renumbered in packed order (the kernel attends them as a row of their own)."""
        chunks = [s for s in self.slices if s.num_queries >= min_tokens]
        if not chunks:
            return
        self.prompts = [_prompt_chunk(s, self.block_size, self.kv_pool.device, self.null_slot) for s in chunks]
        rest = [s for s in self.slices if all(s is not c for c in chunks)]
        if rest:
            starts = itertools.accumulate((s.num_queries for s in rest), initial=0)
            compact = [SequenceSlice(start, s.num_queries, s.num_computed, s.block_table) for s, start in zip(rest, starts)]
            self.rest = _kernel_queries(compact, self.block_size)[0]
            self.rest_rows = torch.cat([torch.arange(s.query_start, s.query_start + s.num_queries) for s in rest])

    def torch_groups(self) -> list[AttentionGroup]:
        if self._groups is None:  # a kernel step with a layer torch must attend
            scratch = torch.empty(len(self.slot_mapping), dtype=torch.long)
            self._groups = _torch_groups(self.slices, self.block_size, self.kv_pool.device, scratch, self.null_slot)
        return self._groups

    def windowed_decode(self, window: int | None) -> KernelDecode:
        """The kernel's decode metadata for a layer seeing ``window`` keys at most (None: all of them)."""
        if window is None:
            return self.kernel_decode
        if window not in self._windowed:
            d = self.kernel_decode
            slots, counts = _window_rows(d.key_slots, torch.arange(len(d.key_counts)), d.key_counts, window)
            self._windowed[window] = KernelDecode(slots, counts)
        return self._windowed[window]

    def windowed_queries(self, window: int | None) -> KernelQueries:
        """The kernel's query metadata for a layer seeing ``window`` keys at most: one row per query, starting at
        its window (None, or no query past its window: the per-sequence rows)."""
        q = self.kernel_queries
        if window is None or int(q.query_keys.max()) <= window:
            return q
        if window not in self._windowed:
            slots, counts = _window_rows(q.key_slots, q.query_seq, q.query_keys, window)
            self._windowed[window] = KernelQueries(slots, torch.arange(len(counts), device=counts.device), counts)
        return self._windowed[window]


def _prompt_chunk(s: SequenceSlice, block_size: int, device: torch.device, null_slot: int) -> PromptChunk:
    if s.num_computed == 0:
        return PromptChunk(s.query_start, s.num_queries)
    keys = s.num_computed + s.num_queries
    mask = torch.ones(s.num_queries, keys, dtype=torch.bool, device=device).tril(diagonal=s.num_computed)
    return PromptChunk(s.query_start, s.num_queries, _key_slots([s], [keys], block_size, null_slot)[0].to(device), mask)


def _window_rows(key_slots: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, window: int):
    """For each of ``rows`` of ``key_slots`` (seeing its first ``counts`` keys), the slots of its last ``window``
    keys at most, from the window's first: ([N, min(window, L)] slots, [N] counts)."""
    kept = counts.clamp(max=window)  # [N]
    start = counts - kept  # [N] first key in the window
    width = int(kept.max())
    index = (start.unsqueeze(1) + torch.arange(width, device=counts.device)).clamp(max=key_slots.shape[1] - 1)
    return key_slots[rows.unsqueeze(1), index].contiguous(), kept


def _null_slot(kv_pool: torch.Tensor) -> int:
    """The pool's last slot: past every block, zero (runner.py)."""
    return kv_pool.shape[2] - 1


def _key_slots(slices: Sequence[SequenceSlice], counts: list[int], block_size: int, null_slot: int | None) -> torch.Tensor:
    """[B, max count] pool slot of every key of each sequence; past its count, or in a block handed back (a sliding
    window's), ``null_slot``: masked, but still read by a padded SDPA, where a masked NaN or inf (another request's
    overflow, a stale slot) would still make every row of the batch NaN (0 * inf). None: our kernel's rows, which
    it reads only up to each count and within each window (a slot of block 0 there, never read)."""
    num_keys = max(counts)
    num_blocks = -(-num_keys // block_size)
    tables = torch.tensor([_padded(s.block_table[:num_blocks], num_blocks) for s in slices])  # [B, blocks]; -1: none
    slots = (tables.clamp(min=0).unsqueeze(-1) * block_size + torch.arange(block_size)).view(len(slices), -1)[:, :num_keys]
    if null_slot is None:
        return slots.contiguous()
    outside = (tables < 0).repeat_interleave(block_size, dim=1)[:, :num_keys]
    outside |= torch.arange(num_keys) >= torch.tensor(counts).unsqueeze(1)
    return slots.masked_fill(outside, null_slot).contiguous()


def _padded(blocks: Sequence[int], length: int) -> list[int]:
    return [*blocks, *[-1] * (length - len(blocks))]


def _kernel_decode(slices: Sequence[SequenceSlice], block_size: int, device: torch.device) -> tuple[KernelDecode, torch.Tensor]:
    """A decode step for the CPU kernel: key slots and counts, and each sequence's new slot (its last key's)."""
    counts = [s.num_computed + 1 for s in slices]
    new_slots = [s.block_table[s.num_computed // block_size] * block_size + s.num_computed % block_size for s in slices]
    decode = KernelDecode(_key_slots(slices, counts, block_size, None).to(device), torch.tensor(counts, device=device))
    return decode, torch.tensor(new_slots, device=device)


def _kernel_queries(slices: Sequence[SequenceSlice], block_size: int) -> tuple[KernelQueries, torch.Tensor]:
    """Per packed query: its sequence's row of key slots, the keys it sees, and the slot its key goes to."""
    lengths = torch.tensor([s.num_queries for s in slices])
    starts = torch.tensor([s.query_start for s in slices])
    computed = torch.tensor([s.num_computed for s in slices])
    key_slots = _key_slots(slices, (computed + lengths).tolist(), block_size, None)  # [S, L]
    seq = torch.repeat_interleave(torch.arange(len(slices)), lengths)  # [T] in slice order
    offset = torch.arange(len(seq)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    positions = computed[seq] + offset
    packed = starts[seq] + offset  # where each query lies in the packed row
    query_seq, query_keys, slot_mapping = (torch.empty(len(seq), dtype=torch.long) for _ in range(3))
    query_seq[packed], query_keys[packed], slot_mapping[packed] = seq, positions + 1, key_slots[seq, positions]
    return KernelQueries(key_slots, query_seq, query_keys), slot_mapping


def _torch_groups(slices: Sequence[SequenceSlice], block_size: int, device: torch.device,
                  slot_mapping: torch.Tensor, null_slot: int) -> list[AttentionGroup]:
    decodes = [s for s in slices if s.num_queries == 1]
    prefills = [s for s in slices if s.num_queries > 1]
    return [_group(g, block_size, device, slot_mapping, null_slot) for g in (decodes, prefills) if g]


def _group(
    slices: Sequence[SequenceSlice], block_size: int, device: torch.device, slot_mapping: torch.Tensor, null_slot: int
) -> AttentionGroup:
    """Padded attention metadata for ``slices``; also writes their new tokens' slots into ``slot_mapping``.

    A few whole-batch tensor ops, not a few per sequence: per-sequence ops took 5 ms of a 32-sequence
    decode step (~140 ms) on a 2-core AVX2 EPYC.
    """
    counts = [s.num_computed + s.num_queries for s in slices]
    num_queries, num_keys = max(s.num_queries for s in slices), max(counts)
    key_slots = _key_slots(slices, counts, block_size, null_slot)
    per_seq = torch.tensor([[s.query_start, s.num_queries, s.num_computed] for s in slices]).T  # [3, B]
    starts, lengths, computed = per_seq[0].unsqueeze(1), per_seq[1].unsqueeze(1), per_seq[2].unsqueeze(1)
    offsets = torch.arange(num_queries)
    real = offsets < lengths  # [B, Q]
    query_index = torch.where(real, starts + offsets, starts)  # padded queries repeat a real one, then get dropped
    query_pos = computed + offsets  # position of each query (past the context for padded ones)
    slot_mapping[query_index[real]] = key_slots.gather(1, query_pos.clamp(max=num_keys - 1))[real]
    real_rows = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)
    return AttentionGroup(
        query_index=query_index.flatten().to(device),
        key_slots=key_slots.to(device),
        query_pos=query_pos.to(device),
        real=real.to(device),
        real_rows=None if real_rows is None else real_rows.to(device),
        num_seqs=len(slices),
        num_queries=num_queries,
        whole_prompt=len(slices) == 1 and slices[0].num_computed == 0 and slices[0].num_queries > 1,
    )
