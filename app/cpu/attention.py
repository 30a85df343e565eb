"""Paged attention on CPU through our kernel (``kernels/decode_attention_avx2.c``, ``llm_serve::*_attention``).

torch's attention wants each sequence's keys and values as one tensor, so the paged path gathers
them out of the pool into a copy that SDPA then reads: three passes over the K/V bytes. This kernel
reads each key and value once, in place, through the sequence's slot list; a decode step's new keys
and values it writes into the pool itself. Prefill and mixed steps go through the same per-query
computation (:meth:`PagedAttentionKernel.prefill`), so a token's attention output is the same bits
whichever step computed it, whatever its batch-mates. It serves fp32 queries on CPU over fp32 or bf16 pools; everything else
keeps the gather + SDPA path of ``app/engine/paged_attention.py``.
"""

from __future__ import annotations

import torch

from app.cpu.ops import OPS


class PagedAttentionKernel:
    """The two entry points the paged attention function calls (``app/engine/paged_attention.py``)."""

    name = "avx2"

    def decode(
        self,
        query: torch.Tensor,  # [1, H, B, D]: one query per sequence
        key: torch.Tensor,  # [1, Hkv, B, D]: this step's key of each sequence, written into k_pool first
        value: torch.Tensor,  # [1, Hkv, B, D]
        k_pool: torch.Tensor,  # [slots, Hkv, D]
        v_pool: torch.Tensor,
        new_slots: torch.Tensor,  # [B] int64: the pool slot of each sequence's new key and value
        key_slots: torch.Tensor,  # [B, L] int64: pool slot of each key (the new one too), padded past each count
        key_counts: torch.Tensor,  # [B] int64: keys of each sequence
        scale: float,
    ) -> torch.Tensor:  # [1, B, H, D], as transformers' attention functions return
        return OPS.decode_attention(query, key, value, k_pool, v_pool, new_slots, key_slots, key_counts, scale)

    def prefill(
        self,
        query: torch.Tensor,  # [1, H, T, D]: any step's queries, prefill chunks and decodes side by side
        k_pool: torch.Tensor,  # [slots, Hkv, D], this step's keys already written
        v_pool: torch.Tensor,
        key_slots: torch.Tensor,  # [S, L] int64: pool slot of each key of each sequence
        query_seq: torch.Tensor,  # [T] int64: the key_slots row of each query's sequence
        query_keys: torch.Tensor,  # [T] int64: keys each query sees (its position + 1)
        scale: float,
    ) -> torch.Tensor:  # [1, T, H, D]
        """Each query attended exactly as :meth:`decode` attends a decode step's: the same bits for a token
        whether a prefill chunk, a decode step, a prefix-cache hit or a recompute after preemption computed it."""
        return OPS.prefill_attention(query, k_pool, v_pool, key_slots, query_seq, query_keys, scale)
