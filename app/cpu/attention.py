"""Paged attention on AVX2 CPUs (``kernels/decode_attention_avx2.c``; built by ``cpu_kernels``).

torch's attention wants each sequence's keys and values as one tensor, so the paged path gathers
them out of the pool into a copy that SDPA then reads: three passes over the K/V bytes. This kernel
reads each key and value once, in place, through the sequence's slot list; a decode step's new keys
and values it writes into the pool itself (no index_copy_ calls). Prefill and mixed steps go through
the same per-query computation (:meth:`DecodeAttentionKernel.prefill`), so a token's attention output
is the same bits whichever step computed it. It serves fp32 pools on CPU; everything else keeps the
gather + SDPA path. Measured in docs/engine.md.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from app.engine.cpu_kernels import load_library, profiler_label


class DecodeAttentionKernel:
    label = "llm_serve::decode_attention"  # its name in torch's profiler

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_attention.argtypes = [
            ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
        ]
        lib.decode_attention.restype = None
        lib.prefill_attention.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float]
        lib.prefill_attention.restype = None
        self._lib = lib

    def __call__(
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
        _, heads, seqs, head_dim = query.shape
        query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        qs, ks, vs = query.stride(), key.stride(), value.stride()
        out = torch.empty(1, seqs, heads, head_dim, dtype=torch.float32)
        with profiler_label(self.label):
            self._lib.decode_attention(
                query.data_ptr(), qs[2], qs[1], key.data_ptr(), ks[2], ks[1], value.data_ptr(), vs[2], vs[1],
                new_slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), key_slots.data_ptr(), key_counts.data_ptr(),
                out.data_ptr(), seqs, heads, k_pool.shape[1], head_dim, key_slots.shape[1], scale,
            )
        return out

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
        """Each query attended exactly as :meth:`__call__` attends a decode step's: the same bits for a token
        whether a prefill chunk, a decode step, a prefix-cache hit or a recompute after preemption computed it."""
        _, heads, tokens, head_dim = query.shape
        if query.stride(-1) != 1:
            query = query.contiguous()
        qs = query.stride()
        out = torch.empty(1, tokens, heads, head_dim, dtype=torch.float32)
        with profiler_label(self.label):
            self._lib.prefill_attention(
                query.data_ptr(), qs[2], qs[1], k_pool.data_ptr(), v_pool.data_ptr(), key_slots.data_ptr(), key_slots.shape[1],
                query_seq.data_ptr(), query_keys.data_ptr(), out.data_ptr(), tokens, heads, k_pool.shape[1], head_dim, scale,
            )
        return out


@functools.cache
def load_decode_attention() -> DecodeAttentionKernel | None:
    lib = load_library("decode_attention_avx2")
    return DecodeAttentionKernel(lib) if lib is not None else None
