"""The kernels a GPTQ 4-bit layer can run on CPU, each packing the layer's codes once into its layout and applying it.

- ``torch-int4``: torch's ``_weight_int4pack_mm_for_cpu``, the op GPTQModel's CPU layer calls, with GPTQModel's
  numbers (scales and zero offsets rounded to bf16, activations and outputs rounded to bf16), minus the layer's
  per-call input gather and first-call repacking. Its cost grows with every few rows as if each were a fresh pass
  over the weights: ~80 GFLOP/s at any row count on a 2-core AVX2 EPYC.
- ``int4-avx512-bf16``: ours (``kernels/linear_avx512bf16.c``, CPUs with avx512_bf16): each code turned into bf16
  in registers, products by ``vdpbf16ps``, a group's zero and fp16 scale applied once to its fp32 sum, every
  output summed in one fixed order (the same bits alone or in any batch).
- ``dequant-fp32`` / ``dequant-bf16``: the layer's weight rebuilt at each call from its codes, then one dense
  product (MKL's sgemm; oneDNN's bf16 GEMM, on AMX tiles where the CPU has them). Rebuilding costs a pass over the
  weight (~0.5 ns a weight on 2 cores), which a product of many rows (a prefill chunk) amortises; the weight is
  not kept, so the layer stays 4-bit in memory, and a large one is rebuilt a tile of columns at a time.

All of them round the activations to bf16, as GPTQModel does. ``dequant-fp32`` rebuilds the checkpoint's weight
exactly ((code - zero) x fp16 scale fits fp32's mantissa), as ours applies it; ``dequant-bf16`` rounds it to bf16
(2^-9 of a weight, under 4% of a quantization step), ``torch-int4`` rounds the scales to bf16 (the same order).
Which one runs which row count is measured per machine (``kernel_choice.py``, from ``gptq.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.cpu.linear_kernels import bf16_products_available, onednn_bf16_supported
from app.cpu.ops import OPS

GROUP_COLS = 64  # columns per group of our kernel's packed layout (the bf16 kernel's)
_INT4_CENTER = 8  # torch's int4 op computes (code - 8) * scale + offset
_INT4_COLUMNS = 16  # and takes output columns in blocks of this many
TILE_BYTES = 16 << 20  # the rebuilt fp32 weight of a larger layer is made this much at a time (bounded memory, in cache)


@dataclass
class Int4Weights:
    """A 4-bit layer as its checkpoint states it: ``codes`` [out, in] (0..15), ``scales`` (fp16 values, as fp32) and
    ``zeros`` (0..15, as fp32) [in / group_size, out]; the weight is (code - zero) x scale."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @classmethod
    def from_dense(cls, weight: torch.Tensor, group_size: int) -> Int4Weights:
        """Asymmetric min-max 4-bit codes of ``weight`` per group of inputs (random weights for timing a kernel)."""
        n, k = weight.shape
        groups = weight.detach().float().view(n, k // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp_min(1e-6).half().float()
        zeros = (-low / scales).round().clamp(0, 15)
        codes = (groups / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15)
        return cls(codes.view(n, k).to(torch.uint8), scales.t().contiguous(), zeros.t().contiguous(), group_size)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] fp32 weight: (code - zero) x scale."""
        per_input = lambda t: t.float().repeat_interleave(self.group_size, dim=0).t()  # noqa: E731  [out, in]
        return (self.codes.float() - per_input(self.zeros)) * per_input(self.scales)


class TorchInt4Kernel:
    name = "torch-int4"
    group_sizes = (32, 64, 128, 256)  # what torch's op takes (a checkpoint's 16, 48, 96 are not)

    def pack(self, q: Int4Weights) -> tuple[torch.Tensor, torch.Tensor, int]:
        n = q.codes.shape[0]
        padded = -(-n // _INT4_COLUMNS) * _INT4_COLUMNS  # the op takes whole blocks of columns; padding: code 8, scale 0
        codes = torch.full((padded, q.codes.shape[1]), _INT4_CENTER, dtype=torch.int32)
        codes[:n] = q.codes
        scales_and_offsets = q.scales.new_zeros(q.scales.shape[0], padded, 2, dtype=torch.bfloat16)
        scales = q.scales.to(torch.bfloat16)
        scales_and_offsets[:, :n, 0] = scales
        scales_and_offsets[:, :n, 1] = (_INT4_CENTER - q.zeros.to(torch.bfloat16)) * scales  # GPTQModel's, in bf16 as it computes them
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scales_and_offsets, q.group_size

    def apply(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        weights, scales_and_offsets, group_size = packed
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weights, group_size, scales_and_offsets)[:, :out_features]
        y = y.float().view(*x.shape[:-1], out_features)
        return y if bias is None else y.add_(bias)


class OursInt4Kernel:
    name = "int4-avx512-bf16"

    def pack(self, q: Int4Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return pack_codes(q.codes), pack_per_group(q.scales, torch.float16), pack_per_group(q.zeros, torch.uint8), q.group_size

    def apply(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        codes, scales, zeros, group_size = packed
        return OPS.linear_int4_bf16dot(x, codes, scales, zeros, bias, out_features, group_size)


class DequantKernel:
    """The weight rebuilt from nibbles at each call, then a dense product in fp32 (MKL) or bf16 (oneDNN, AMX)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = "dequant-fp32" if dtype == torch.float32 else "dequant-bf16"

    def pack(self, q: Int4Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Nibbles [out, group, half a group]: the low one holds the group's first half, the high one its second, so
        each half unpacks into one contiguous run; fp16 scales and zero codes [out, group], as small as GPTQ's own."""
        n, k = q.codes.shape
        halves = q.codes.view(n, k // q.group_size, 2, q.group_size // 2)
        nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous()
        return nibbles, q.scales.t().to(torch.float16).contiguous(), q.zeros.t().to(torch.uint8).contiguous()

    def apply(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        nibbles, scales, zeros = packed
        rows = x.to(torch.bfloat16).to(self.dtype)
        columns = max(1, TILE_BYTES // (nibbles.shape[1] * nibbles.shape[2] * 2 * 4))  # output columns a tile rebuilds
        if columns >= out_features:
            y = F.linear(rows, dequantize(nibbles, scales, zeros).to(self.dtype))
        else:  # a large layer: rebuilt a tile of columns at a time, each used while it is in cache
            y = rows.new_empty(*rows.shape[:-1], out_features)
            for start in range(0, out_features, columns):
                tile = slice(start, start + columns)
                y[..., tile] = F.linear(rows, dequantize(nibbles[tile], scales[tile], zeros[tile]).to(self.dtype))
        y = y.float() if self.dtype != torch.float32 else y
        return y if bias is None else y.add_(bias)


def dequantize(nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32: code x scale - zero x scale, exact (each term and the result fit fp32's mantissa)."""
    n, groups, half = nibbles.shape
    weight = torch.empty(n, groups, 2, half)
    weight[:, :, 0] = nibbles & 0xF
    weight[:, :, 1] = nibbles >> 4
    weight = weight.view(n, groups, 2 * half)
    scales = scales.float()
    weight.mul_(scales.unsqueeze(-1)).sub_((zeros * scales).unsqueeze(-1))
    return weight.view(n, groups * 2 * half)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Our kernel's layout: ``codes`` [out, in] (0..15) -> [group of 64 columns][input pair][half][32 bytes]: byte j
    of half h holds value j of panel 2h (16 columns) in its low nibble and of panel 2h + 1 in its high one, value v
    of a panel being its column v // 2 at input 2 * pair + v % 2 (the bf16 kernel's order). Padded columns: code 0."""
    n, k = codes.shape
    groups = -(-n // GROUP_COLS)
    padded = codes.new_zeros(groups * GROUP_COLS, k, dtype=torch.uint8)
    padded[:n] = codes
    values = padded.view(groups, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4).reshape(groups, k // 2, 2, 2, 32)
    return (values[:, :, :, 0] | (values[:, :, :, 1] << 4)).contiguous().view(-1)


def pack_per_group(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our kernel's layout: scales (fp16) or zero codes (uint8) [in / group_size, out] -> [group of 64 columns]
    [quantization group][64]; padded columns 0."""
    quant_groups, n = values.shape
    groups = -(-n // GROUP_COLS)
    padded = values.new_zeros(quant_groups, groups * GROUP_COLS, dtype=dtype)
    padded[:, :n] = values
    return padded.view(quant_groups, groups, GROUP_COLS).permute(1, 0, 2).contiguous().view(-1)


FIXED_ORDER_INT4 = frozenset({"int4-avx512-bf16"})  # one summation order whatever the row count


def available_int4_kernels() -> dict[str, object]:
    """Every 4-bit kernel this CPU and torch build run, by name (ours needs avx512_bf16; ``dequant-bf16``, oneDNN's
    bf16 path)."""
    kernels = [OursInt4Kernel() if bf16_products_available() else None,
               TorchInt4Kernel() if torch_int4_supported() else None,
               DequantKernel(torch.float32),
               DequantKernel(torch.bfloat16) if onednn_bf16_supported() else None]
    return {kernel.name: kernel for kernel in kernels if kernel is not None}


@functools.cache
def torch_int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
