"""GPTQ 4-bit layers on the fastest 4-bit kernel of this CPU for each row count (``int4_kernels.py``).

GPTQModel runs a 4-bit layer on CPU through torch's ``_weight_int4pack_mm_for_cpu`` after gathering its input and
casting it at every call; that op's cost grows with every few rows as if each were a fresh pass over the weights
(a 576 x 1536 layer on a 2-core AVX-512 EPYC: ~30 us at 1 row, ~90 at 8, ~450 at 40), so a batch of decodes, a step
verifying speculative drafts and above all a prefill chunk pay for each row nearly in full. The engine therefore
takes each layer this module can read exactly into an :class:`Int4Linear` on the kernels of ``int4_kernels.py``.
With ``engine.cpu_gptq_kernel: auto`` each layer shape and row bucket runs on the fastest of them, timed on this
CPU at the first start and cached (``kernel_choice.py``, the Linear layers' mechanism; the incumbent is ours where
the CPU has avx512_bf16, else torch's op, and a challenger must beat it by the margin): on a 2-core AVX2 EPYC
torch's op keeps up to 64 rows and the rebuilt weight on MKL takes prefill chunks. With ``engine.batch_invariant``
only our fixed-order kernel is taken (where the CPU lacks it, GPTQModel's layers stay). ``torch`` leaves GPTQModel's
layers; a kernel's name runs it for every row count.

Only layers the 4-bit layout describes exactly are taken: 4-bit, input features in whole groups in order (no
act-order permutation), no adapter, not yet run by GPTQModel (which repacks its weights on the first call); the
codes read back must give GPTQModel's own dequantized weight, or the layer is left as it is. A shape whose buckets
pick two kernels holds two 4-bit copies of its codes (the log line says so).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from app.config import CPU_GPTQ_KERNELS
from app.cpu import kernel_choice
from app.cpu.build import build_id
from app.cpu.int4_kernels import (
    FIXED_ORDER_INT4,
    Int4Weights,
    available_int4_kernels,
)
from app.cpu.kernel_choice import LinearShape, computes_its_product
from app.cpu.linear import bucketed
from app.cpu.linear_kernels import RowBucketKernel
from app.cpu.ops import available

logger = logging.getLogger(__name__)

_NEEDS = {"int4-avx512-bf16": "the CPU kernels and avx512_bf16", "torch-int4": "torch's CPU int4 ops",
          "dequant-bf16": "oneDNN's bf16 products (AVX-512 or AMX)"}


class Int4Linear(nn.Module):
    """A GPTQ layer's codes in its kernel's layout (one per kernel where a shape mixes them); ``forward`` is the kernel."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, kernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.codes.shape
        self.group_size, self.kernel = weights.group_size, kernel
        self.packed = kernel.pack(weights)
        for index, tensor in enumerate(_tensors(self.packed)):  # buffers too: the model's memory counts them
            self.register_buffer(f"packed_{index}", tensor, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernels compute and answer in fp32; a bf16 model's next layer takes its own dtype back
        return self.kernel.apply(x, self.packed, self.bias, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, kernel={self.kernel.name}"


def gptq_weights(module: nn.Module) -> Int4Weights | None:
    """The codes, scales and zeros of a GPTQModel 4-bit layer the 4-bit layout describes exactly, else None (the
    reason at debug level)."""
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
    weights = Int4Weights(codes, scales, zeros, group_size)
    reference = module.dequantize_weight().float().t()  # GPTQModel's own reading of the same tensors
    if not torch.equal(reference, weights.dequantized().to(module.scales.dtype).float()):
        logger.debug("GPTQ layer left to GPTQModel's kernel: its dequantized weight differs from the codes' reading")
        return None
    return weights


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


def pack_gptq_linears(model: nn.Module, choice: str = "auto", batch_invariant: bool = False) -> str | None:
    """Replace every GPTQ 4-bit layer of ``model`` this module reads exactly by an :class:`Int4Linear` on the kernel(s)
    ``choice`` (``engine.cpu_gptq_kernel``) gives; returns what runs them, for the start-up log (None: none replaced)."""
    if choice == "torch":
        return None
    found = [(parent, name, child, weights) for parent in list(model.modules()) for name, child in list(parent.named_children())
             if hasattr(child, "qweight") and hasattr(child, "dequantize_weight") and (weights := gptq_weights(child)) is not None]
    if not found:
        return None
    shapes = {_shape_of(weights) for *_, weights in found}
    kernels = choose_int4_kernels(choice, batch_invariant, sorted(shapes))
    if kernels is None:
        return None
    replaced, computing = [], {}  # shape -> whether its kernel computes its first layer's product
    for parent, name, child, weights in found:
        shape = _shape_of(weights)
        layer = Int4Linear(weights, getattr(child, "bias", None), kernels[shape])
        if shape not in computing:  # (every layer: ~1 CPU-s per 200 of them at a start; a kernel's bug shows on any)
            computing[shape] = _computes(layer, weights)
        if computing[shape]:
            setattr(parent, name, layer)
            replaced.append(layer)
    return describe(replaced) if replaced else None


def _computes(layer: Int4Linear, weights: Int4Weights) -> bool:
    """Whether ``layer``'s kernel computes the product of its dequantized weight (GPTQModel's own reading of it, which
    gptq_weights checked; kernel_choice.computes_its_product); where not, GPTQModel's layer stays, said in the log."""
    computes, error = computes_its_product(layer, weights.dequantized().float(), layer.bias)
    if computes:
        return True
    logger.error("int4 kernel %s computes a %d x %d GPTQ layer %.1f%% off its weight's product: GPTQModel's layer kept "
                 "(a kernel bug on this CPU; engine.cpu_gptq_kernel: torch avoids it)", layer.kernel.name,
                 layer.out_features, layer.in_features, 100 * error)
    return False


def choose_int4_kernels(choice: str, batch_invariant: bool, shapes: list[tuple[int, int, int]]) -> dict | None:
    """(out, in, group size) -> the kernel for it: the one named, else with ``auto`` the bake-off's per row bucket;
    None where GPTQModel's layers should stay (batch-invariant mode on a CPU without our fixed-order kernel)."""
    kernels = available_int4_kernels()
    if choice != "auto":
        if choice not in CPU_GPTQ_KERNELS:
            raise ValueError(f"engine.cpu_gptq_kernel {choice!r} is not one of {', '.join(CPU_GPTQ_KERNELS)}")
        if choice not in kernels:
            raise ValueError(f"engine.cpu_gptq_kernel is {choice!r}, which needs {_NEEDS.get(choice, 'nothing more')} and "
                             f"does not run on this CPU or torch build; it runs: {', '.join(['auto', 'torch', *kernels])}")
        if batch_invariant and choice not in FIXED_ORDER_INT4:
            raise ValueError(f"engine.batch_invariant needs a fixed-order kernel, and engine.cpu_gptq_kernel is {choice!r}: "
                             "use auto or int4-avx512-bf16")
        takes = getattr(kernels[choice], "group_sizes", None)
        refused = sorted({g for *_, g in shapes} - set(takes)) if takes else []
        if refused:
            raise ValueError(f"engine.cpu_gptq_kernel {choice!r} does not take this checkpoint's group size {refused[0]} "
                             f"(it takes {', '.join(map(str, takes))}): use auto")
        return dict.fromkeys(shapes, kernels[choice])
    fixed = [kernels[name] for name in FIXED_ORDER_INT4 if name in kernels]
    if batch_invariant or len(kernels) < 2:
        return dict.fromkeys(shapes, fixed[0]) if fixed else None
    chosen = {}
    for group_size in sorted({g for *_, g in shapes}):
        taking = {name: kernel for name, kernel in kernels.items() if group_size in getattr(kernel, "group_sizes", (group_size,))}
        incumbent = fixed[0].name if fixed else "torch-int4" if "torch-int4" in taking else next(iter(taking))
        timed = {name: TimedOnDense(kernel, group_size) for name, kernel in taking.items()}
        linear_shapes = [LinearShape(n, k, weight_bytes=0.5) for n, k, g in shapes if g == group_size]
        decisions = kernel_choice.choose(linear_shapes, timed, incumbent, f"gptq-int4 group {group_size}",
                                         build_id() if available() else None)
        for shape in linear_shapes:
            chosen[(shape.out_features, shape.in_features, group_size)] = bucketed(decisions[shape.key], kernels)
    return chosen


class TimedOnDense:
    """A 4-bit kernel as the bake-off times it: on random dense weights quantized here."""

    def __init__(self, kernel, group_size: int) -> None:
        self.kernel, self.name, self.group_size = kernel, kernel.name, group_size

    def pack(self, weight: torch.Tensor):
        return self.kernel.pack(Int4Weights.from_dense(weight, self.group_size))

    def apply(self, x: torch.Tensor, packed, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return self.kernel.apply(x, packed, bias, out_features)


def _shape_of(weights: Int4Weights) -> tuple[int, int, int]:
    return (*weights.codes.shape, weights.group_size)


def describe(layers: list[Int4Linear]) -> str:
    """Which kernels run the 4-bit layers, how many, and the memory of the second copies where a shape mixes two."""
    kernels = Counter(layer.kernel.name for layer in layers)
    second = sum(_bytes(layer.packed[1:]) for layer in layers if isinstance(layer.kernel, RowBucketKernel))
    extra = f", {second / 2**20:.0f} MB in second copies of their codes" if second else ""
    return ", ".join(f"{name}: {count} layers" for name, count in kernels.most_common()) + extra


def _bytes(packed) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(packed))


def _tensors(packed) -> list[torch.Tensor]:
    """The tensors of a kernel's packed layout (a tensor, or nested tuples of them and ints)."""
    if isinstance(packed, torch.Tensor):
        return [packed]
    return [tensor for part in packed for tensor in _tensors(part)] if isinstance(packed, tuple) else []
