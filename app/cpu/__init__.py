"""The CPU fast path: our kernels as torch ops, and the one call that puts them under a model.

Layout: ``kernels/*.c`` (AVX2/FMA C kernels; ``linear_avx512bf16.c`` for CPUs with avx512_bf16),
``csrc/ops.cpp`` (their typed torch ops, ``torch.ops.llm_serve.*``), ``build.py`` + ``ops.py`` (build
once, load, fake implementations), and one Python face per part: ``linear`` (prepacked GEMM on the kernels of
``linear_kernels``, chosen per shape and row count by ``kernel_choice``; fused
sibling projections, gated MLPs), ``gptq`` (GPTQ 4-bit layers on the kernels of ``int4_kernels``, chosen as the Linear ones), ``attention``
(paged attention read in place), ``norm`` (RMSNorm), ``rotary`` (RoPE), ``decoder`` (a decoder layer's
forward in one frame), ``argmax`` (greedy sampling); ``threads`` keeps the engine's OpenMP team one thread per CPU
(called by the server once the core is warmed up, not by :func:`install_fast_path`).

The runner calls :func:`install_fast_path` once per engine. Each part is installed only where it gives
the module's own results (the bits, or float rounding for norms), checked on a test input first, and
each can be set back to torch's ops in ``EngineConfig``; a CPU or machine where the kernels cannot be
built keeps torch's ops everywhere but in Linear layers, where ``auto`` still times oneDNN's packed products
against torch's (a library route, not ours) and keeps the faster (the fallbacks are the model as transformers
runs it, to the order of a sum).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from app.config import EngineConfig
from app.cpu.attention import PagedAttentionKernel
from app.cpu.decoder import DecoderLayerForward, fuse_decoder_layers, unfuse_decoder_layers
from app.cpu.gptq import pack_gptq_linears
from app.cpu.linear import GatedMLPForward, describe_packed, pack_cpu_linears
from app.cpu.norm import FusedRMSNormForward, fuse_rms_norms, unfuse_rms_norms
from app.cpu.ops import unavailable_reason

logger = logging.getLogger(__name__)
KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16)  # pools our attention kernel reads (queries fp32)


@dataclass
class FastPath:
    """What :func:`install_fast_path` put in place for one model."""

    kernels: str  # "on", or why the kernels are off
    attention: PagedAttentionKernel | None = None  # paged attention through the kernel (fp32 queries on CPU)
    parts: dict[str, str] = field(default_factory=dict)  # part -> what runs it, for the start-up log line

    def describe(self) -> str:
        return f"CPU kernels: {self.kernels}; " + "; ".join(f"{part}: {how}" for part, how in self.parts.items())


def install_fast_path(model: nn.Module, config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                      weight_dtype: torch.dtype | None = None, bf16_products: bool = False) -> FastPath:
    """Install on ``model`` what this CPU supports and ``config`` allows; logs one line saying what runs where.

    ``dtype``: the model's activations; ``kv_dtype``: the KV pool's (default: ``dtype``)."""
    kv_dtype = kv_dtype or dtype
    reason = unavailable_reason()
    path = FastPath("on" if reason is None else f"off ({reason})")
    if _device(model).type != "cpu":
        path.parts["all"] = f"torch (model on {_device(model)})"
        if config.batch_invariant:  # cuBLAS and its peers choose a product's reduction order by the batch's shape
            logger.warning("engine.batch_invariant: the model is on %s, where the fixed-order kernels do not run: a row's "
                           "products may sum differently beside other rows (the guarantee holds on CPUs)", _device(model))
        return _logged(path)
    pack_cpu_linears(model, config.cpu_linear_kernel, weight_dtype or torch.float32, bf16_products, config.batch_invariant)
    path.parts["linear"] = describe_packed(model)
    gptq = pack_gptq_linears(model, config.cpu_gptq_kernel, config.batch_invariant)  # GPTQ 4-bit layers
    if gptq:
        path.parts["gptq linear"] = gptq
    unfuse_rms_norms(model)  # a model an earlier engine of this process fused with other settings
    norms = fuse_rms_norms(model) if config.cpu_norm_kernel == "auto" else 0
    path.parts["rms_norm"] = f"kernel ({norms} modules)" if norms else "torch"
    unfuse_decoder_layers(model)
    rotary_kernel = config.cpu_rotary_kernel == "auto" and reason is None
    layers = fuse_decoder_layers(model, rotary_kernel) if config.cpu_decoder_layer == "auto" else 0
    path.parts["decoder layers"] = f"one frame ({layers}, rope {'kernel' if rotary_kernel else 'torch'})" if layers else "module forward"
    if reason is None and config.cpu_attention_kernel != "torch" and dtype == torch.float32 and kv_dtype in KERNEL_KV_DTYPES:
        path.attention = PagedAttentionKernel()
    path.parts["attention"] = "kernel" if path.attention else "gather + SDPA"
    path.parts["KV cache"] = str(kv_dtype).removeprefix("torch.")
    path.parts["argmax"] = "kernel" if reason is None else "torch"
    path.parts["bf16 native"] = "yes" if _native_bf16() else "no"
    return _logged(path)


# The forwards installed in place of a module's own: their kernels (norms, RoPE, SiLU, a product's residual add)
# are checked on a test input as they are installed, not on the model's activations.
_FUSED_FORWARDS = (FusedRMSNormForward, GatedMLPForward, DecoderLayerForward)


@contextlib.contextmanager
def modules_own_forwards(model: nn.Module):
    """``model`` with every fused forward set aside (each module runs its class's own ``forward``), then put back.

    What stays of the fast path inside is the packed Linear and 4-bit layers, each checked against its weight's
    product as it is installed: a reference taken in here (the load-time parity check's) does not share the
    fused kernels it is meant to judge."""
    fused = {m: m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), _FUSED_FORWARDS)}
    for module in fused:
        del module.forward
    try:
        yield
    finally:
        for module, forward in fused.items():
            module.forward = forward


def _logged(path: FastPath) -> FastPath:
    logger.info("%s", path.describe())
    return path


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _native_bf16() -> bool:
    from app.models.loader import cpu_has_native_bf16  # the loader's own test, which picks dtype: auto

    return cpu_has_native_bf16()
