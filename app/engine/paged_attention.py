"""Paged attention for unmodified transformers models, through transformers' attention interface.

The model runs one packed batch per step: all scheduled tokens of all requests side by side in a
single ``[1, T]`` row (mixed prefill chunks and decodes). Each attention layer calls
:func:`paged_attention_forward`, which

1. writes this step's keys and values into the layer's slice of the KV pool at their slots, and
2. attends each request's queries to its own keys, read back from the pool through its block table.

The step's metadata (:class:`~app.engine.paged_batch.PagedBatch`) reaches every layer through the attention
module itself (:class:`PagedStep`, set by :func:`register_paged_attention`), not through the forward's keyword
arguments: some decoder layers do not pass those on to their attention (StableLM's), and would attend the
packed row as one sequence. A layer's own attention arguments are honoured or refused by name
(:func:`attention_options`): a per-layer sliding window and attention logit softcapping (Gemma 2) are
implemented; anything else (attention sinks, non-causal layers, ...) raises :class:`UnsupportedAttentionError`,
which the load-time parity check turns into a refusal to serve.

Requests are attended in at most two padded groups (decodes with one query each, and prefill
chunks), so a step costs two SDPA calls per layer whatever the batch size. A step of decodes only
(the steady state) attends the queries where they lie, with no gather of queries or scatter of
outputs. On AVX2 CPUs with fp32 activations (fp32 or bf16 pool) steps run our kernel instead (``app/cpu/attention.py``),
which reads each key and value once in the pool instead of gathering copies for SDPA, and attends
each query, prefill or decode, with one computation: a token's bits do not depend on how its
sequence was cut into steps or on its batch-mates (SDPA's do). Where SDPA was timed faster on this CPU
(``attention_choice.py``), decode-only steps take the torch route, or long prompt chunks SDPA beside the kernel's
other queries; ``engine.batch_invariant`` keeps the kernel for everything.
A softcapped layer takes the torch route.
The model's own Linear layers are untouched, so bitsandbytes and GPTQ layers run as loaded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.engine.paged_batch import AttentionGroup, PagedBatch, SequenceSlice  # noqa: F401 - SequenceSlice: re-exported

ATTENTION_NAME = "llm_serve_paged"

# Arguments transformers' attention modules pass that change nothing for paged attention (positions are in the
# batch; there is no cache object; attention weights are never returned; a MoE's router flag passes through).
_NO_EFFECT = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
                        "output_router_logits"})
_SINKS = ("s_aux", "sinks")


class UnsupportedAttentionError(NotImplementedError):
    """A layer asks for attention the paged engine does not implement (the message names what)."""


@dataclass
class PagedStep:
    """The step in flight, shared by every attention module of one model: the runner sets ``batch`` for the
    length of a forward pass; outside one (``generate``, a reference forward) it is None."""

    batch: PagedBatch | None = None


@dataclass(frozen=True)
class AttentionOptions:
    window: int | None = None  # a query sees its last ``window`` keys (itself included); None: all before it
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax


def attention_options(kwargs: dict[str, Any]) -> AttentionOptions:
    """What a layer's attention keyword arguments ask of paged attention; refuses what it cannot honour."""
    options = {"window": kwargs.pop("sliding_window", None), "softcap": kwargs.pop("softcap", None)}
    for name, value in kwargs.items():
        if value is None or name in _NO_EFFECT or (name == "is_causal" and value):
            continue
        if name in _SINKS:
            raise UnsupportedAttentionError(f"the model uses attention sinks ({name}, as gpt-oss does), which the paged engine does not implement")
        if name == "is_causal":
            raise UnsupportedAttentionError("the model has non-causal (bidirectional) attention layers; the paged engine serves causal decoders")
        raise UnsupportedAttentionError(f"the model's attention layers pass {name}={_short(value)}, which the paged engine does not implement")
    if options["window"] is not None and options["window"] <= 0:
        raise UnsupportedAttentionError(f"the model asks for a sliding window of {options['window']} tokens")
    return AttentionOptions(**options)


def _short(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]


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
    """``paged_batch``: the step's metadata, else the one the runner set on ``module`` (:class:`PagedStep`)."""
    if paged_batch is None:
        step = getattr(module, "paged_step", None)
        paged_batch = step.batch if step is not None else None
    if paged_batch is None:  # plain transformers use of the model (e.g. generate): behave as transformers would
        return _unpaged(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    options = attention_options(kwargs)
    paged_batch.attended[module.layer_idx] = options.window
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k_pool, v_pool = paged_batch.kv_pool[module.layer_idx]  # [slots, Hkv, D] each
    if key.shape[1] != k_pool.shape[1] or key.shape[-1] != k_pool.shape[-1]:
        raise ValueError(f"attention layer {module.layer_idx} passes {key.shape[1]} key heads of size {key.shape[-1]} where "
                         f"its config states {k_pool.shape[1]} of {k_pool.shape[-1]} (num_key_value_heads, head_dim): its "
                         "layer reshapes or repeats its keys before attention, which the paged KV pool does not hold")
    kernel = paged_batch.kernel if options.softcap is None else None
    if kernel is not None and paged_batch.kernel_decode is not None:  # it writes the new keys and values itself
        d = paged_batch.windowed_decode(options.window)
        return kernel.decode(query, key, value, k_pool, v_pool, paged_batch.slot_mapping, d.key_slots, d.key_counts, scale), None
    # a bf16 pool under an fp32 model (the bf16-product path) stores keys and values rounded to bf16
    k_pool.index_copy_(0, paged_batch.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, paged_batch.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))
    if kernel is not None and paged_batch.prompts and options.window is None:
        return _prompt_chunks_through_sdpa(kernel, query, key, value, k_pool, v_pool, paged_batch, scale), None
    if kernel is not None:
        q = paged_batch.windowed_queries(options.window)
        return kernel.prefill(query, k_pool, v_pool, q.key_slots, q.query_seq, q.query_keys, scale), None
    groups = paged_batch.torch_groups()
    if paged_batch.decode_only:
        return _attend_decodes(query, k_pool, v_pool, groups[0], scale, options), None
    packed = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(packed)  # [T, H, D]
    for group in groups:
        group_out = _attend_group(packed, k_pool, v_pool, group, scale, options)  # [B*Q, H, D]
        if group.real_rows is None:
            out[group.query_index] = group_out
        else:
            out[group.query_index[group.real_rows]] = group_out[group.real_rows]
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' SDPA path returns


def _prompt_chunks_through_sdpa(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                                v_pool: torch.Tensor, paged_batch: PagedBatch, scale: float) -> torch.Tensor:
    """Each long prompt chunk through SDPA (from the prompt's first token: its causal path over this step's keys, as
    the pool stores them, no gather and no mask; deeper: its keys from the pool under the chunk's causal mask), the
    step's other queries through our kernel; [1, T, H, D]."""
    _, num_heads, num_tokens, head_dim = query.shape
    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    if paged_batch.rest is not None:
        rest, rows = paged_batch.rest, paged_batch.rest_rows
        out[0, rows] = kernel.prefill(query[:, :, rows], k_pool, v_pool, rest.key_slots, rest.query_seq, rest.query_keys, scale)[0]
    for chunk in paged_batch.prompts:
        span = slice(chunk.query_start, chunk.query_start + chunk.length)
        if chunk.key_slots is None:
            keys = key[:, :, span].to(k_pool.dtype).to(query.dtype)  # [1, Hkv, L, D]; a bf16 pool's rounding, as read back
            values = value[:, :, span].to(v_pool.dtype).to(query.dtype)
        else:
            keys = k_pool.index_select(0, chunk.key_slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
            values = v_pool.index_select(0, chunk.key_slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
        attended = F.scaled_dot_product_attention(query[:, :, span], keys, values, attn_mask=chunk.mask,
                                                  is_causal=chunk.mask is None, scale=scale, enable_gqa=True)
        out[0, span] = attended[0].transpose(0, 1)
    return out


def _unpaged(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """Outside a step: SDPA, as transformers runs these models by default; a layer with softcapping or sinks
    (which SDPA would drop) through its modeling module's own eager attention."""
    if kwargs.get("softcap") is not None or any(kwargs.get(name) is not None for name in _SINKS):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise UnsupportedAttentionError(f"{type(module).__name__} needs eager attention outside the engine")
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
    """SDPA, or with softcapping the same product written out: softcap * tanh(scores / softcap), masked, softmax."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [B, Hkv, R*Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def _attend_decodes(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, scale: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """A decode-only step: query ``t`` is sequence ``t``'s only one, so queries and outputs are views, not copies."""
    _, num_heads, num_seqs, head_dim = query.shape  # [1, H, B, D]
    keys, values = _gather_kv(k_pool, v_pool, group, head_dim, query.dtype)  # [B, Hkv, L, D] each
    kv_heads = keys.shape[1]
    repeat = num_heads // kv_heads
    # contiguous: torch's CPU SDPA ran 5x slower on the permuted view at 32 sequences (a copy is cheap here)
    folded = query[0].reshape(kv_heads, repeat, num_seqs, head_dim).permute(2, 0, 1, 3).contiguous()  # [B, Hkv, R, D]
    attended = _attention(folded, keys, values, group.folded_mask(repeat, options.window), scale, options.softcap)
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
    packed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup, scale: float,
    options: AttentionOptions,
) -> torch.Tensor:
    b, q = group.num_seqs, group.num_queries
    num_heads, head_dim = packed.shape[1], packed.shape[2]
    if group.whole_prompt and options.window is None and options.softcap is None:
        return _causal_prompt(packed, k_pool, v_pool, group, scale)
    keys, values = _gather_kv(k_pool, v_pool, group, head_dim, packed.dtype)  # [B, Hkv, L, D] each
    kv_heads = keys.shape[1]
    repeat = num_heads // kv_heads
    # Grouped-query attention without copying keys: the `repeat` query heads that share a key/value
    # head are folded into the query axis, so SDPA sees Hkv heads of repeat*Q queries each.
    query = packed[group.query_index].view(b, q, kv_heads, repeat, head_dim)  # [B, Q, Hkv, R, D]
    query = query.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, repeat * q, head_dim)  # [B, Hkv, R*Q, D]
    attended = _attention(query, keys, values, group.folded_mask(repeat, options.window), scale, options.softcap)
    attended = attended.view(b, kv_heads, repeat, q, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, R, D]
    return attended.reshape(b * q, num_heads, head_dim)  # [B*Q, H, D]


def _causal_prompt(packed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: AttentionGroup,
                   scale: float) -> torch.Tensor:
    """One sequence's prompt from its first token: SDPA's causal path over its keys, no mask (on a GPU: the
    flash-attention kernels, which an explicit mask rules out), the query heads sharing a KV head by ``enable_gqa``."""
    head_dim = packed.shape[2]
    keys, values = _gather_kv(k_pool, v_pool, group, head_dim, packed.dtype)  # [1, Hkv, L, D] each
    query = packed[group.query_index].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)  # [Q, H, D]


def register_paged_attention(model: torch.nn.Module) -> PagedStep:
    """Route every attention layer of ``model`` through the paged attention function; returns the step holder
    the runner sets each step's batch on (every module with a ``layer_idx`` shares it; engines built over one
    model share it too, and step one at a time)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
    layers = [module for module in model.modules() if hasattr(module, "layer_idx")]
    step = next((m.paged_step for m in layers if isinstance(getattr(m, "paged_step", None), PagedStep)), PagedStep())
    for module in layers:
        module.paged_step = step
    return step
