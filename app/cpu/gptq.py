"""GPTQ 4-bit Linear layers on our kernel (``llm_serve::linear_int4_bf16dot``) on CPUs with avx512_bf16.

GPTQModel runs a 4-bit layer on CPU through torch's ``_weight_int4pack_mm_for_cpu``, whose cost grows with
every few rows as if each were a fresh pass over the weights (on a 2-core AVX-512 EPYC a 576 x 1536 layer:
~30 us at 1 row, ~90 at 8, ~450 at 40): a step that verifies speculative drafts, or a batch of decodes, pays
for each row nearly in full. Ours turns each code into bf16 in registers by a table lookup (cheap enough to
redo for every tile of 6 rows), multiplies with ``vdpbf16ps`` as the bf16 kernel does, and applies a group's
zero and scale once to its sum. Served, a GPTQ model runs 1.3-1.6x faster on it than on GPTQModel's kernel
(docs/quantization.md; the products alone: ``python -m app.bench gemm --kernels gptq-int4 torch-int4``).

Numbers: activations are rounded to bf16, as torch's int4 kernel rounds them; the codes are exact in bf16, so
each product ``x * code`` is exact and summed in fp32 over a group, then ``scale * (sum - zero * sum of x)``
in fp32 with the checkpoint's own fp16 scales, where GPTQModel's CPU path rounds scales and zeros to bf16 first
(~20x further from the checkpoint's weights). Scales stay fp16 and zeros bytes, so the layer is as small as
GPTQ's own packing. Every output is summed in one fixed order: a row has the same bits alone or in any batch.

Only layers this layout describes exactly are taken: 4-bit, input features in whole groups in order (no
act-order permutation), no adapter, not yet run by GPTQModel (which repacks its weights on the first call);
the codes read back must give GPTQModel's own dequantized weight, or the layer is left as it is.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from app.cpu.ops import OPS

logger = logging.getLogger(__name__)

GROUP_COLS = 64  # columns per group of the packed layout (the bf16 kernel's)


class Int4Linear(nn.Module):
    """A GPTQ layer's weights in the kernel's layout; ``forward`` is the kernel."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.register_buffer("codes", pack_codes(codes))
        self.register_buffer("scales", pack_per_group(scales, torch.float16))
        self.register_buffer("zeros", pack_per_group(zeros, torch.uint8))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.linear_int4_bf16dot(x, self.codes, self.scales, self.zeros, self.bias, self.out_features, self.group_size)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, kernel=int4-avx512-bf16"


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` [out, in] (0..15) -> [group of 64 columns][input pair][half][32 bytes]: byte j of half h holds
    value j of panel 2h (16 columns) in its low nibble and of panel 2h + 1 in its high one, value v of a panel
    being its column v // 2 at input 2 * pair + v % 2 (the bf16 kernel's order). Padded columns: code 0."""
    n, k = codes.shape
    groups = -(-n // GROUP_COLS)
    padded = codes.new_zeros(groups * GROUP_COLS, k, dtype=torch.uint8)
    padded[:n] = codes
    values = padded.view(groups, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4).reshape(groups, k // 2, 2, 2, 32)
    return (values[:, :, :, 0] | (values[:, :, :, 1] << 4)).contiguous().view(-1)


def pack_per_group(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales (fp16) or zero codes (uint8) [in / group_size, out] -> [group of 64 columns][quantization group][64];
    padded columns 0."""
    quant_groups, n = values.shape
    groups = -(-n // GROUP_COLS)
    padded = values.new_zeros(quant_groups, groups * GROUP_COLS, dtype=dtype)
    padded[:, :n] = values
    return padded.view(quant_groups, groups, GROUP_COLS).permute(1, 0, 2).contiguous().view(-1)


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [out, in] fp32 weight the layer stands for: (code - zero) * scale."""
    per_input = lambda t: t.float().repeat_interleave(group_size, dim=0).t()  # noqa: E731  [out, in]
    return (codes.float() - per_input(zeros)) * per_input(scales)


def gptq_codes(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [out, in], scales, zeros [in / group_size, out]) of a GPTQModel 4-bit layer this layout describes
    exactly, else None (the reason at debug level)."""
    reason = _unsupported(module)
    if reason is not None:
        logger.debug("GPTQ layer left to GPTQModel's kernel: %s", reason)
        return None
    k, group_size = module.in_features, module.group_size
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((module.qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(k, -1).t().to(torch.uint8)
    zeros = ((module.qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF).reshape(k // group_size, -1)
    codes, zeros = codes[: module.out_features].contiguous(), zeros[:, : module.out_features].float().contiguous()
    scales = module.scales.float().contiguous()
    if not torch.equal(scales.half().float(), scales):
        logger.debug("GPTQ layer left to GPTQModel's kernel: its scales are not fp16 values")
        return None
    reference = module.dequantize_weight().float().t()  # GPTQModel's own reading of the same tensors
    if not torch.equal(reference, dequantized(codes, scales, zeros, group_size).to(module.scales.dtype).float()):
        logger.debug("GPTQ layer left to GPTQModel's kernel: its dequantized weight differs from the codes' reading")
        return None
    return codes, scales, zeros


def _unsupported(module: nn.Module) -> str | None:
    if getattr(module, "bits", None) != 4:
        return f"{getattr(module, 'bits', '?')}-bit"
    if getattr(module, "adapter", None):
        return "it has an adapter"
    if getattr(module, "linear_mode", None) is not None or getattr(module, "qweight", None) is None:
        return "GPTQModel has already repacked it"
    if module.qweight.dtype != torch.int32 or getattr(module, "pack_dtype", torch.int32) != torch.int32:
        return "not packed in int32 words"
    k, group_size = module.in_features, module.group_size
    if group_size <= 0 or group_size % 16 or k % group_size or module.qweight.shape[0] * 8 != k:
        return f"group size {group_size} is not a multiple of 16 that splits its {k} inputs evenly"
    if not torch.equal(module.g_idx.long().cpu(), torch.arange(k) // group_size):
        return "act-order (its inputs are permuted)"
    return None


def pack_gptq_linears(model: nn.Module) -> int:
    """Replace every GPTQ 4-bit layer of ``model`` this kernel runs exactly by an :class:`Int4Linear`; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not hasattr(child, "qweight") or not hasattr(child, "dequantize_weight"):
                continue
            found = gptq_codes(child)
            if found is None:
                continue
            setattr(parent, name, Int4Linear(*found, child.group_size, getattr(child, "bias", None)))
            replaced += 1
    return replaced
