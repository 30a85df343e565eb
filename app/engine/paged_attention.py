"""Paged attention for unmodified transformers models, through transformers' attention interface.

The model runs one packed batch per step: all scheduled tokens of all requests side by side in a
single ``[1, T]`` row (mixed prefill chunks and decodes). Each attention layer calls
:func:`paged_attention_forward`, which

1. writes this step's keys and values into the layer's slice of the KV pool at their slots, and
2. attends each request's queries to its own keys, read back from the pool through its block table.

Requests are attended in at most two padded groups (decodes with one query each, and prefill
chunks), so a step costs two SDPA calls per layer whatever the batch size. A step of decodes only
(the steady state) attends the queries where they lie, with no gather of queries or scatter of
outputs. On AVX2 CPUs with fp32 activations (fp32 or bf16 pool) every step runs our kernel instead (``app/cpu/attention.py``),
which reads each key and value once in the pool instead of gathering copies for SDPA, and attends
each query, prefill or decode, with one computation: a token's bits do not depend on how its
sequence was cut into steps or on its batch-mates (SDPA's do). Everything that does not
depend on the layer (slots, gather indices, masks) is built once per step in :class:`PagedBatch`.
The model's own Linear layers are untouched, so bitsandbytes and GPTQ layers run as loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:  # the engine core takes the kernel from the runner; it does not load it
    from app.cpu.attention import PagedAttentionKernel

ATTENTION_NAME = "llm_serve_paged"


@dataclass
class SequenceSlice:
    """One request's part of the packed batch (built by the runner from the scheduler output)."""

    query_start: int  # index of its first new token in the packed row
    num_queries: int  # tokens computed this step
    num_computed: int  # tokens already in the cache before this step (the first query's position)
    block_table: Sequence[int]


@dataclass
class AttentionGroup:
    """Requests attended together as a padded batch: ``B`` sequences, ``Q`` queries, ``L`` keys.

    A decode step attended by the CPU kernel needs only the key slots and counts: the other tensors are None.
    """

    query_index: torch.Tensor | None  # [B*Q] packed index of each padded query (padding repeats a real one)
    key_slots: torch.Tensor  # [B, L] pool slot of each key (padding: slots of block 0 or unused ones, masked out)
    key_counts: torch.Tensor  # [B] keys of each sequence (its context up to the end of this step)
    mask: torch.Tensor | None  # [B, 1, Q, L] True where the query may attend the key
    real_rows: torch.Tensor | None  # [n] rows of the flattened [B*Q] output that are real queries
    num_seqs: int
    num_queries: int
    _folded: dict[int, torch.Tensor] | None = None

    def folded_mask(self, repeat: int) -> torch.Tensor:
        """The mask for ``repeat`` query heads folded into the query axis: [B, 1, R*Q, L] (built once per step)."""
        if repeat == 1:
            return self.mask
        if self._folded is None:
            self._folded = {}
        if repeat not in self._folded:
            b, _, q, keys = self.mask.shape
            self._folded[repeat] = self.mask.unsqueeze(2).expand(b, 1, repeat, q, keys).reshape(b, 1, repeat * q, keys)
        return self._folded[repeat]


@dataclass
class KernelQueries:
    """Any step's queries for the CPU kernel: each one attended as a decode step attends its one query."""

    kernel: PagedAttentionKernel
    key_slots: torch.Tensor  # [S, L] pool slot of each key of each sequence (padding past its count)
    query_seq: torch.Tensor  # [T] the key_slots row of each packed query
    query_keys: torch.Tensor  # [T] keys each query sees: its position + 1


@dataclass
class PagedBatch:
    """Per-step attention metadata, passed to every layer through the model's forward kwargs."""

    kv_pool: torch.Tensor  # [layers, 2, slots, kv_heads, head_dim], owned by the runner
    slot_mapping: torch.Tensor  # [T] where each new token's key/value is written
    groups: list[AttentionGroup]
    decode_only: bool = False  # one group of one query per sequence, in packed order (steady-state decode)
    decode_kernel: PagedAttentionKernel | None = None  # attends decode-only steps in place (CPU, fp32 queries)
    kernel_queries: KernelQueries | None = None  # attends the other steps with the same kernel (CPU, fp32 queries)

    @classmethod
    def build(
        cls, kv_pool: torch.Tensor, block_size: int, slices: Sequence[SequenceSlice],
        decode_kernel: PagedAttentionKernel | None = None,
    ) -> "PagedBatch":
        device = kv_pool.device
        if decode_kernel is not None and all(s.num_queries == 1 for s in slices):
            group, slot_mapping = _kernel_decode_group(slices, block_size, device)
            return cls(kv_pool, slot_mapping, [group], True, decode_kernel)
        if decode_kernel is not None:
            queries, slot_mapping = _kernel_queries(decode_kernel, slices, block_size)
            return cls(kv_pool, slot_mapping, [], kernel_queries=queries)
        slot_mapping = torch.empty(sum(s.num_queries for s in slices), dtype=torch.long)  # filled by _group
        decodes = [s for s in slices if s.num_queries == 1]
        prefills = [s for s in slices if s.num_queries > 1]
        groups = [_group(g, block_size, device, slot_mapping) for g in (decodes, prefills) if g]
        decode_only = bool(decodes) and not prefills
        return cls(kv_pool, slot_mapping.to(device), groups, decode_only)  # a kernel's decode steps returned above


def _key_slots(slices: Sequence[SequenceSlice], counts: list[int], block_size: int) -> torch.Tensor:
    """[B, max count] pool slot of every key of each sequence (past its count: padding, never attended)."""
    num_keys = max(counts)
    num_blocks = -(-num_keys // block_size)
    tables = torch.tensor([_padded(s.block_table[:num_blocks], num_blocks) for s in slices])  # [B, blocks], 0 past the end
    return (tables.unsqueeze(-1) * block_size + torch.arange(block_size)).view(len(slices), -1)[:, :num_keys].contiguous()


def _padded(blocks: Sequence[int], length: int) -> list[int]:
    return [*blocks, *[0] * (length - len(blocks))]


def _kernel_decode_group(
    slices: Sequence[SequenceSlice], block_size: int, device: torch.device
) -> tuple[AttentionGroup, torch.Tensor]:
    """A decode step for the CPU kernel: key slots and counts, and each sequence's new slot (its last key's)."""
    counts = [s.num_computed + 1 for s in slices]
    new_slots = [s.block_table[s.num_computed // block_size] * block_size + s.num_computed % block_size for s in slices]
    group = AttentionGroup(None, _key_slots(slices, counts, block_size).to(device), torch.tensor(counts, device=device),
                           None, None, num_seqs=len(slices), num_queries=1)
    return group, torch.tensor(new_slots, device=device)


def _kernel_queries(
    kernel: PagedAttentionKernel, slices: Sequence[SequenceSlice], block_size: int
) -> tuple[KernelQueries, torch.Tensor]:
    """Per packed query: its sequence's row of key slots, the keys it sees, and the slot its key goes to."""
    lengths = torch.tensor([s.num_queries for s in slices])
    starts = torch.tensor([s.query_start for s in slices])
    computed = torch.tensor([s.num_computed for s in slices])
    key_slots = _key_slots(slices, (computed + lengths).tolist(), block_size)  # [S, L]
    seq = torch.repeat_interleave(torch.arange(len(slices)), lengths)  # [T] in slice order
    offset = torch.arange(len(seq)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    positions = computed[seq] + offset
    packed = starts[seq] + offset  # where each query lies in the packed row
    query_seq, query_keys, slot_mapping = (torch.empty(len(seq), dtype=torch.long) for _ in range(3))
    query_seq[packed], query_keys[packed], slot_mapping[packed] = seq, positions + 1, key_slots[seq, positions]
    return KernelQueries(kernel, key_slots, query_seq, query_keys), slot_mapping


def _group(
    slices: Sequence[SequenceSlice], block_size: int, device: torch.device, slot_mapping: torch.Tensor
) -> AttentionGroup:
    """Padded attention metadata for ``slices``; also writes their new tokens' slots into ``slot_mapping``.

    A few whole-batch tensor ops, not a few per sequence: per-sequence ops took 5 ms of a 32-sequence
    decode step (~140 ms) on a 2-core AVX2 EPYC.
    """
    counts = [s.num_computed + s.num_queries for s in slices]
    num_queries, num_keys = max(s.num_queries for s in slices), max(counts)
    key_slots = _key_slots(slices, counts, block_size)
    per_seq = torch.tensor([[s.query_start, s.num_queries, s.num_computed] for s in slices]).T  # [3, B]
    starts, lengths, computed = per_seq[0].unsqueeze(1), per_seq[1].unsqueeze(1), per_seq[2].unsqueeze(1)
    offsets = torch.arange(num_queries)
    real = offsets < lengths  # [B, Q]
    query_index = torch.where(real, starts + offsets, starts)  # padded queries repeat a real one, then get dropped
    query_pos = computed + offsets  # position of each query (past the context for padded ones)
    slot_mapping[query_index[real]] = key_slots.gather(1, query_pos.clamp(max=num_keys - 1))[real]
    key_counts = torch.tensor(counts, dtype=torch.long)
    key_pos = torch.arange(num_keys)
    # Causal within the sequence; keys past its context are padding. Padded queries see key 0 only
    # (a fully masked row would make SDPA return NaN).
    mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [B, Q, L]
    mask &= real.unsqueeze(-1) | (key_pos == 0).view(1, 1, -1)
    real_rows = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)
    return AttentionGroup(
        query_index=query_index.flatten().to(device),
        key_slots=key_slots.to(device),
        key_counts=key_counts.to(device),
        mask=mask.unsqueeze(1).to(device),
        real_rows=None if real_rows is None else real_rows.to(device),
        num_seqs=len(slices),
        num_queries=num_queries,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_batch: PagedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged_batch is None:  # plain transformers use of the model (e.g. generate): behave as SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    k_pool, v_pool = paged_batch.kv_pool[module.layer_idx]  # [slots, Hkv, D] each
    if paged_batch.decode_kernel is not None:  # it writes the new keys and values into the pool itself
        group, scale = paged_batch.groups[0], scaling if scaling is not None else query.shape[-1] ** -0.5
        kernel = paged_batch.decode_kernel
        return kernel.decode(query, key, value, k_pool, v_pool, paged_batch.slot_mapping, group.key_slots, group.key_counts, scale), None
    # a bf16 pool under an fp32 model (the bf16-product path) stores keys and values rounded to bf16
    k_pool.index_copy_(0, paged_batch.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, paged_batch.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))
    if (queries := paged_batch.kernel_queries) is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return queries.kernel.prefill(query, k_pool, v_pool, queries.key_slots, queries.query_seq, queries.query_keys, scale), None

    if paged_batch.decode_only:
        return _attend_decodes(query, k_pool, v_pool, paged_batch.groups[0], scaling), None
    packed = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(packed)  # [T, H, D]
    for group in paged_batch.groups:
        group_out = _attend_group(packed, k_pool, v_pool, group, scaling)  # [B*Q, H, D]
        if group.real_rows is None:
            out[group.query_index] = group_out
        else:
            out[group.query_index[group.real_rows]] = group_out[group.real_rows]
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' SDPA path returns


def _attend_decodes(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, scaling: float | None
) -> torch.Tensor:
    """A decode-only step: query ``t`` is sequence ``t``'s only one, so queries and outputs are views, not copies."""
    _, num_heads, num_seqs, head_dim = query.shape  # [1, H, B, D]
    keys, values = _gather_kv(k_pool, v_pool, group, head_dim, query.dtype)  # [B, Hkv, L, D] each
    kv_heads = keys.shape[1]
    repeat = num_heads // kv_heads
    # contiguous: torch's CPU SDPA ran 5x slower on the permuted view at 32 sequences (a copy is cheap here)
    folded = query[0].reshape(kv_heads, repeat, num_seqs, head_dim).permute(2, 0, 1, 3).contiguous()  # [B, Hkv, R, D]
    attended = F.scaled_dot_product_attention(folded, keys, values, attn_mask=group.folded_mask(repeat), scale=scaling)
    return attended.reshape(1, num_seqs, num_heads, head_dim)  # [1, T, H, D]


def _gather_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values read back from the pool: [B, Hkv, L, D] each."""
    slots = group.key_slots.view(-1)  # index_select: ~2x faster than advanced indexing on CPU for this gather
    kv_heads = k_pool.shape[1]
    keys = k_pool.index_select(0, slots).view(group.num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_pool.index_select(0, slots).view(group.num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    return keys.to(dtype), values.to(dtype)  # a bf16 pool under fp32 queries: widened (exactly) for SDPA


def _attend_group(
    packed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, scaling: float | None
) -> torch.Tensor:
    b, q = group.num_seqs, group.num_queries
    num_heads, head_dim = packed.shape[1], packed.shape[2]
    keys, values = _gather_kv(k_pool, v_pool, group, head_dim, packed.dtype)  # [B, Hkv, L, D] each
    kv_heads = keys.shape[1]
    repeat = num_heads // kv_heads
    # Grouped-query attention without copying keys: the `repeat` query heads that share a key/value
    # head are folded into the query axis, so SDPA sees Hkv heads of repeat*Q queries each.
    query = packed[group.query_index].view(b, q, kv_heads, repeat, head_dim)  # [B, Q, Hkv, R, D]
    query = query.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, repeat * q, head_dim)  # [B, Hkv, R*Q, D]
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.folded_mask(repeat), scale=scaling)
    attended = attended.view(b, kv_heads, repeat, q, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, R, D]
    return attended.reshape(b * q, num_heads, head_dim)  # [B*Q, H, D]


def register_paged_attention(model: torch.nn.Module) -> None:
    """Route every attention layer of ``model`` through the paged attention function."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
