"""A pre-norm decoder layer's ``forward`` in one Python frame, over the packed CPU kernels.

With the matrix products and the small ops on our kernels, about half of a one-sequence decode step
on a 2-core AVX2 EPYC (bf16 weights, ~26 ms) is outside the GEMMs, much of it Python:
transformers' decoder layer calls 11 modules (norms, attention, the q/k/v siblings, o_proj, the MLP)
and looks up its configuration and attention function on every call. This ``forward`` does the module's work
in the module's order (norm, q/k/v from the shared GEMM, RoPE as the modeling module's
``apply_rotary_pos_emb`` computes it (our kernel where it gives that function's bits, ``rotary.py``),
the registered attention function, o_proj, residual, norm, MLP, residual) with everything resolved
once: same ops on the same inputs, so the same bits, and it is installed only where that was checked
on a test input (as ``linear.py`` does for gated MLPs). The two residual sums are taken inside o_proj and
down_proj where their kernel stores its outputs with the residual added (``linear_kernels.apply_add``), in the
order and with the bits of adding them after.

Only layers of the Llama family's exact shape qualify: children ``self_attn``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``; an attention of exactly q/k/v/o projections
whose q/k/v share one packed GEMM (so fp32 CPU weights, not quantized ones); no hooks; no clamp of q/k/v
(OLMo's ``clip_qkv``: the test input may never reach it). Anything else (q/k norms, sandwich norms, a KV cache
object) keeps the module's own ``forward``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from app.cpu.linear import GatedMLPForward, PackedSiblingLinear, linear_add
from app.cpu.rotary import modeling_rotary, rotary_for

logger = logging.getLogger(__name__)

_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_CHECK_TOKENS = 3


class DecoderLayerForward:
    """``layer``'s new ``forward``: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` without the module calls."""

    def __init__(self, layer: nn.Module, rotary_kernel: bool = True) -> None:
        attn = layer.self_attn
        self.layer, self.attn = layer, attn
        self.shared = attn.q_proj.shared  # the one GEMM of q, k and v
        self.total = sum(self.shared.sizes)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        original = modeling_rotary(attn)
        self.rotary = (rotary_for(original) if rotary_kernel else None) or original
        self.attention = _attention_functions()[attn.config._attn_implementation]
        # bound forwards (a fused one where a module has it): the module calls' own cost was the point
        self.input_norm, self.post_norm = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.mlp = layer.mlp.forward
        fused_mlp = layer.mlp.__dict__.get("forward")  # a gated MLP on its shared GEMM adds its residual in down_proj
        self.mlp_add = fused_mlp.add if isinstance(fused_mlp, GatedMLPForward) else None

    def __call__(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        if past_key_values is not None or position_embeddings is None:  # generate()'s cache: the module's path
            return type(self.layer).forward(self.layer, hidden_states, attention_mask=attention_mask,
                                            position_embeddings=position_embeddings, past_key_values=past_key_values, **kwargs)
        hidden_states = self._attend(self.input_norm(hidden_states), attention_mask, position_embeddings, kwargs, hidden_states)
        return self._mlp_add(self.post_norm(hidden_states), hidden_states)

    def _mlp_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp_add(x, residual) if self.mlp_add is not None else residual + self.mlp(x)

    def _attend(self, x: torch.Tensor, attention_mask, position_embeddings, kwargs: dict, residual: torch.Tensor) -> torch.Tensor:
        """``residual + attention(x)``, the sum taken inside o_proj where its kernel can."""
        shared, input_shape = self.shared, x.shape[:-1]
        head_shape = (*input_shape, -1, self.head_dim)
        query, key, value = shared.kernel.apply(x, shared.packed_weight, shared.bias, self.total).split(shared.sizes, dim=-1)
        query, key, value = query.view(head_shape).transpose(1, 2), key.view(head_shape).transpose(1, 2), value.view(head_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = self.rotary(query, key, cos, sin)
        # kwargs as the attention module passes them on (position_ids, use_cache, ...)
        out, _ = self.attention(self.attn, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return linear_add(self.attn.o_proj, out.reshape(*input_shape, -1).contiguous(), residual)


def fuse_decoder_layers(model: nn.Module, rotary_kernel: bool = True) -> int:
    """Give every qualifying decoder layer of ``model`` a one-frame ``forward`` where it gives the same bits.

    ``rotary_kernel``: RoPE through our kernel where it gives the modeling module's bits (else its function).
    """
    fused, mismatched = 0, set()
    for layer in model.modules():
        if not _qualifies(layer):
            continue
        candidate = DecoderLayerForward(layer, rotary_kernel)
        if _same_bits(layer, candidate):
            layer.forward = candidate
            fused += 1
        else:
            mismatched.add(type(layer).__name__)
    if mismatched:
        logger.debug("decoder layers of %s keep their own forward: the one-frame forward did not reproduce it", ", ".join(sorted(mismatched)))
    return fused


def unfuse_decoder_layers(model: nn.Module) -> None:
    for layer in model.modules():
        if isinstance(layer.__dict__.get("forward"), DecoderLayerForward):
            del layer.forward


def _qualifies(layer: nn.Module) -> bool:
    if {name for name, _ in layer.named_children()} != _LAYER_CHILDREN or "forward" in layer.__dict__ or layer.training:
        return False  # (training: the module applies attention dropout)
    attn = layer.self_attn
    if {name for name, _ in attn.named_children()} != _ATTENTION_CHILDREN or "forward" in attn.__dict__:
        return False
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    if not all(isinstance(p, PackedSiblingLinear) for p in (q, k, v)) or not (q.shared is k.shared is v.shared):
        return False
    if (q.member, k.member, v.member) != (0, 1, 2) or len(q.shared.sizes) != 3:
        return False
    if not all(hasattr(attn, name) for name in ("head_dim", "scaling", "layer_idx", "config")):
        return False
    if attn.config._attn_implementation not in _attention_functions():
        return False
    if getattr(attn.config, "clip_qkv", None) is not None:
        return False  # OLMo clamps q, k and v before RoPE: a test input rarely reaches the clip, real activations do
    if modeling_rotary(attn) is None:
        return False
    return not any(_has_hooks(m) for m in layer.modules())


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)


@torch.no_grad()
def _same_bits(layer: nn.Module, candidate: DecoderLayerForward) -> bool:
    """Does ``candidate`` give the layer's own output on a test input (attention without a paged batch: SDPA), and
    pass its attention the same arguments (a window or softcap the module adds would otherwise be dropped)?"""
    attn = layer.self_attn
    generator = torch.Generator().manual_seed(0)  # CPU tensors: the packed q/k/v GEMM is a CPU kernel
    x = torch.randn(1, _CHECK_TOKENS, attn.config.hidden_size, generator=generator)
    angles = torch.rand(1, _CHECK_TOKENS, attn.head_dim, generator=generator) * 10
    embeddings = (angles.cos(), angles.sin())
    name = attn.config._attn_implementation
    functions = _attention_functions()
    module_calls, candidate_calls = _AttentionArguments(functions[name]), _AttentionArguments(candidate.attention)
    try:
        functions[name] = module_calls  # the module looks its attention up on each call
        expected = type(layer).forward(layer, x, attention_mask=None, position_embeddings=embeddings)
        del functions[name]
        candidate.attention = candidate_calls
        got = candidate(x, attention_mask=None, position_embeddings=embeddings)
    except Exception:  # noqa: BLE001 - another signature or layout: leave the layer as it is
        return False
    finally:
        if name in functions._local_mapping:
            del functions[name]
        candidate.attention = candidate_calls.inner
    expected = expected[0] if isinstance(expected, tuple) else expected
    same_arguments = module_calls.calls == candidate_calls.calls
    return same_arguments and isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got, expected)


def _attention_functions():
    """transformers' attention registry (imported here: importing app.cpu, as the kernels' light users do, then
    needs torch alone, not transformers' modeling code: ~5 s of CPU)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


# What the decoder layer's caller hands down per call (the one-frame forward passes the caller's on as they are).
_CALLER_ARGUMENTS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


class _AttentionArguments:
    """An attention function that records the keyword arguments the layer itself adds (not tensors, not the
    caller's) to each call: a sliding window, a softcap, a scaling."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, module, *args, **kwargs):
        self.calls.append({k: v for k, v in kwargs.items()
                           if k not in _CALLER_ARGUMENTS and v is not None and not isinstance(v, torch.Tensor)})
        return self.inner(module, *args, **kwargs)
