"""Linear layers on CPU through prepacked weights (the kernels themselves: ``linear_kernels.py``).

torch runs an fp32 ``nn.Linear`` on CPU through MKL's sgemm, whose small-M path is slow on a 2-core AVX2
AMD EPYC: a decode step of 2 sequences took as long as one of 16. The runner therefore
packs every plain fp32 CPU Linear weight once into a kernel's own layout:

- ``avx2``: our 6x16 micro-kernel (``kernels/linear_avx2.c``), 1.4-1.6x oneDNN on the 1-32 row
  products of decode steps on the AVX2 EPYC (it streams the weights at memory speed), 1.2x at 64
  rows, with results that do not depend on the batch: every output is summed in one fixed order.
  It also takes bf16 weights (``weight_dtype``: widened to fp32 in registers, half the bytes to
  stream), and stores an fp32 weight as bf16 by itself when every value is a bf16 value (a bf16
  checkpoint loaded as fp32): half the bytes, bit-identical results;
- ``avx512-bf16``: ours for bf16 products (``kernels/linear_avx512bf16.c``, ``vdpbf16ps``) on CPUs with
  avx512_bf16: activations and weights rounded to bf16, sums in fp32 in one fixed order (the same bits alone
  or in any batch); what ``auto`` takes where the loader chose bf16 products (``dtype`` auto or bfloat16 there);
- ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn``, what IPEX and inductor's freezing use);
- ``onednn-bf16`` (opt-in): oneDNN's bf16 products, activations rounded to bf16 (as a bf16 model computes),
  1.6-1.9x our fp32 kernel from 32 rows on an AVX-512 CPU with avx512_bf16 and 0.55x at one row
  (docs/performance.md). oneDNN sums a row differently with the rows beside it (``app.bench gemm`` checks),
  so with it a request's logprobs, and now and then its greedy tokens, depend on its batch-mates.

``auto`` (the default) runs each weight shape and row count on the fastest of these this CPU runs, as timed at the
first start (``kernel_choice.py``; our fixed-order kernel unless another wins by a margin), or with
``engine.batch_invariant`` our fixed-order kernel for every row count; ``torch`` leaves torch's kernels.
Measurements: docs/engine.md, docs/performance.md.

Only modules whose type is exactly ``nn.Linear`` with fp32 CPU weights are replaced, so quantized
layers (bitsandbytes, GPTQ) and every other device or dtype run as loaded. The packed weight replaces
the dense one (same bytes, or half); a tied output head gets its own packed copy while the embedding keeps
the original, so packing costs about the head's size in memory. Results differ from MKL's only in
float summation order (the last few bits).

Sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj`` of an attention
layer, ``gate_proj``/``up_proj`` of an MLP) are packed as one weight and run as one GEMM, as vLLM's
QKV and merged column layers do: fewer, wider calls (per step ~90 fewer kernel launches on a 30-layer
model). The transformers modules still call each projection by name; the first call computes all of
them and the siblings return their slice of it. A gated MLP (``down(act(gate(x)) * up(x))``) goes one
step further: its ``forward`` runs the shared GEMM and slices it itself, the module's own ops in the
module's own order (so the same bits, checked on a test input before it is switched), without the four
module calls and the siblings' bookkeeping: ~30 us of ~360 a layer at one sequence (~0.9 ms a step). A SiLU
gate and its product run as one kernel call with torch's bits (``activation.py``).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from app.cpu import kernel_choice
from app.cpu.activation import silu_mul, silu_mul_lanes
from app.cpu.build import build_id
from app.cpu.kernel_choice import BUCKETS, LinearShape, computes_its_product
from app.cpu.linear_kernels import (
    FIXED_ORDER,
    LinearKernel,
    RowBucketKernel,
    apply_add,
    bake_off_candidates,
    bf16_exact,
    select_kernel,
)
from app.cpu.ops import available, unavailable_reason

logger = logging.getLogger(__name__)


# Projections that transformers' attention and MLP modules apply to the same input, in call order.
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in the kernel's packed layout."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        _hold(self, kernel.pack(linear.weight))
        self.bias = linear.bias
        self.weight = weight_stand_in(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}"


def weight_stand_in(weight: torch.Tensor) -> torch.Tensor:
    """A packed layer's ``weight``: the original's shape, dtype and device, for a model that reads them (HunYuan's MoE
    router casts its input to its weight's dtype), without its values or storage: NaN wherever anything computes with
    it, which the load-time parity check refuses."""
    return torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def _hold(module: nn.Module, packed: torch.Tensor | tuple) -> None:
    """A packed weight as a (non-persistent) buffer; a tuple of them (one per kernel) as a plain attribute."""
    if isinstance(packed, torch.Tensor):
        module.register_buffer("packed_weight", packed, persistent=False)
    else:
        module.packed_weight = packed


class _SharedProjection:
    """One packed GEMM for sibling projections of the same input; each member reads its slice once."""

    def __init__(self, linears: list[nn.Linear], kernel: LinearKernel) -> None:
        self.kernel = kernel
        self.packed_weight = kernel.pack(torch.cat([linear.weight.detach() for linear in linears]))
        biases = [linear.bias for linear in linears]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None  # held while slices are unread, so `is` cannot alias
        self._unread: dict[int, torch.Tensor] = {}

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or member not in self._unread:  # first sibling called on this input
            fused = self.kernel.apply(x, self.packed_weight, self.bias, sum(self.sizes))
            self._input, self._unread = x, dict(enumerate(fused.split(self.sizes, dim=-1)))
        out = self._unread.pop(member)
        if not self._unread:
            self._input = None
        return out


class PackedSiblingLinear(nn.Module):
    """One of several sibling projections packed together (see :class:`_SharedProjection`)."""

    def __init__(self, shared: _SharedProjection, member: int, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shared, self.member = shared, member
        if member == 0:  # the packed weight is counted once, on the first sibling
            _hold(self, shared.packed_weight)
        self.weight = weight_stand_in(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(self.member, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.shared.kernel.name}, fused_with_siblings=True"


class GatedMLPForward:
    """A gated MLP's ``forward`` on its shared gate/up GEMM: ``down(act(gate) * up)``, as the module computes it;
    a SiLU gate and its product in one kernel call where that gives torch's bits (``activation.py``)."""

    def __init__(self, module: nn.Module, shared: _SharedProjection, silu_lanes: int | None = None) -> None:
        self.module, self.shared, self.width = module, shared, shared.sizes[0]
        self.silu_lanes = silu_lanes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.down_proj(self._hidden(x))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, the sum taken inside the down projection where its kernel can (``apply_add``)."""
        return linear_add(self.module.down_proj, self._hidden(x), residual)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` from the shared GEMM."""
        shared, width = self.shared, self.width
        gate_up = shared.kernel.apply(x, shared.packed_weight, shared.bias, 2 * width)
        if self.silu_lanes is not None and gate_up.dtype == torch.float32:
            return silu_mul(gate_up, self.silu_lanes)
        return self.module.act_fn(gate_up[..., :width]) * gate_up[..., width:]


def linear_add(projection: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + projection(x)``: on a packed layer, summed as its kernel stores the outputs (the same bits)."""
    if isinstance(projection, PackedLinear) and not projection._forward_hooks and not projection._forward_pre_hooks:
        return apply_add(projection.kernel, x, projection.packed_weight, projection.bias, projection.out_features, residual)
    return residual + projection(x)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Give each gated MLP whose gate/up projections share one GEMM a one-GEMM ``forward``, where it gives the same bits."""
    fused = 0
    for module in model.modules():
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        if not (isinstance(gate, PackedSiblingLinear) and isinstance(up, PackedSiblingLinear) and gate.shared is up.shared):
            continue
        if (gate.member, up.member) != (0, 1) or "forward" in module.__dict__ or not hasattr(module, "down_proj") or not hasattr(module, "act_fn"):
            continue
        for candidate in _mlp_forwards(module, gate.shared):
            if _same_bits(module, candidate, gate.in_features):
                module.forward = candidate
                fused += 1
                break
    return fused


def _mlp_forwards(module: nn.Module, shared: _SharedProjection) -> list[GatedMLPForward]:
    """The forwards to try, best first: with the one-call SiLU where the kernel can give torch's bits, then without."""
    lanes = silu_mul_lanes(module.act_fn)
    return ([GatedMLPForward(module, shared, lanes)] if lanes is not None else []) + [GatedMLPForward(module, shared)]


@torch.no_grad()
def _same_bits(module: nn.Module, candidate: GatedMLPForward, in_features: int) -> bool:
    """Does ``candidate`` give exactly the module's own output (another formula, e.g. act on up, would not)?"""
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0))
    try:
        return torch.equal(candidate(x), type(module).forward(module, x))
    except Exception:  # noqa: BLE001 - a forward of another shape or signature: leave it as it is
        return False


def pack_cpu_linears(model: nn.Module, kernel: str = "auto", weight_dtype: torch.dtype = torch.float32,
                     bf16_products: bool = False, batch_invariant: bool = False) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` of ``model`` by a packed one; returns how many.

    ``kernel`` is ``engine.cpu_linear_kernel``: auto (per shape and row bucket, as measured on this CPU, unless
    ``batch_invariant``: then our fixed-order kernel for every row count), avx2, avx512-bf16, onednn, onednn-bf16 or
    torch (nothing replaced); ``weight_dtype`` the packed weights' dtype (bfloat16 with the avx2 kernel only);
    ``bf16_products``: see :func:`select_kernel`.
    """
    groups = [(parent, names, linears) for parent in model.modules() for names, linears in _sibling_groups(parent)]
    grouped = {id(linear) for _, _, linears in groups for linear in linears}
    singles = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
               if _packable(child) and id(child) not in grouped]
    if not groups and not singles:
        return 0
    shapes = _shapes([linears for _, _, linears in groups] + [[child] for _, _, child in singles])
    kernels = choose_kernels(kernel, weight_dtype, bf16_products, batch_invariant, list(shapes.values()))
    if all(chosen is None for chosen in kernels.values()):
        return 0
    replaced, computing = 0, {}  # shape -> whether its kernel computes its first weight's product
    for parent, names, linears in groups:
        shared = _SharedProjection(linears, kernels[_shape_of(linears)])
        if not _checked(computing, _shape_of(linears), shared.kernel, shared.packed_weight, shared.bias, linears):
            continue
        for member, (name, linear) in enumerate(zip(names, linears)):
            setattr(parent, name, PackedSiblingLinear(shared, member, linear))
        replaced += len(names)
    for parent, name, child in singles:
        layer = PackedLinear(child, kernels[_shape_of([child])])
        if _checked(computing, _shape_of([child]), layer.kernel, layer.packed_weight, layer.bias, [child]):
            setattr(parent, name, layer)
            replaced += 1
    fuse_gated_mlps(model)
    _release_checkpoint_mapping(model)
    return replaced


def _checked(computing: dict, shape: tuple[int, int], kernel, packed, bias, linears: list[nn.Linear]) -> bool:
    """Whether ``kernel`` computes the product of the first weight of ``shape`` it packed (the answer kept for the
    shape's others); where not, they stay torch's, said in the log: the load-time parity check's reference runs the
    packed layers too, so only this sees a kernel that multiplies wrongly on this CPU."""
    if shape not in computing:
        weight = torch.cat([linear.weight.detach().float() for linear in linears])  # [out, in]
        computing[shape], error = computes_its_product(lambda x: kernel.apply(x, packed, bias, shape[0]), weight, bias)
        if not computing[shape]:
            logger.error("Linear kernel %s computes a %d x %d layer %.1f%% off its weight's product: torch's kept for "
                         "that shape (a kernel bug on this CPU; engine.cpu_linear_kernel: torch avoids it)",
                         kernel.name, shape[0], shape[1], 100 * error)
    return computing[shape]


def choose_kernels(choice: str, weight_dtype: torch.dtype, bf16_products: bool, batch_invariant: bool,
                   shapes: list[LinearShape]) -> dict[tuple[int, int], LinearKernel]:
    """The kernel for each (out, in) shape: the one ``choice`` names, or with ``auto`` the bake-off's per row bucket."""
    fixed = select_kernel(choice, weight_dtype, bf16_products)
    one_for_all = {(shape.out_features, shape.in_features): fixed for shape in shapes}
    if batch_invariant and (fixed is None or fixed.name not in FIXED_ORDER):
        if choice != "auto":
            raise ValueError(f"engine.batch_invariant needs a fixed-order kernel, and engine.cpu_linear_kernel is {choice!r}: "
                             "use auto, avx2 or avx512-bf16")
        logger.warning("engine.batch_invariant: our fixed-order kernels cannot run here (%s); %s may sum a row "
                       "differently beside other rows", unavailable_reason() or "no fixed-order kernel for this dtype",
                       f"{fixed.name}'s products" if fixed is not None else "torch's products")
    if choice != "auto" or batch_invariant:
        return one_for_all
    if weight_dtype == torch.bfloat16 and not available():
        weight_dtype = torch.float32  # only our kernel streams bf16 weights: they stay fp32 (select_kernel warned)
    candidates = bake_off_candidates(bf16_products, weight_dtype)
    if fixed is None or len(candidates) < 2:
        return one_for_all
    family = "bf16-products" if bf16_products else ("bf16-weights" if weight_dtype == torch.bfloat16 else "fp32")
    decisions = kernel_choice.choose(shapes, candidates, fixed.name, family, build_id() if available() else None)
    return {(shape.out_features, shape.in_features): bucketed(decisions[shape.key], candidates) for shape in shapes}


def bucketed(choice: dict[str, str], candidates: dict[str, LinearKernel]) -> LinearKernel:
    """One kernel where the bake-off chose one for every bucket, else each bucket on its own."""
    names = [choice[bucket.name] for bucket in BUCKETS]
    if len(set(names)) == 1:
        return candidates[names[0]]
    return RowBucketKernel([(bucket, candidates[name]) for bucket, name in zip(BUCKETS, names)])


def _shape_of(linears: list[nn.Linear]) -> tuple[int, int]:
    return sum(linear.out_features for linear in linears), linears[0].in_features


def _shapes(groups: list[list[nn.Linear]]) -> dict[tuple[int, int], LinearShape]:
    """Each distinct packed shape once; whether its weights are bf16 values is read off its first weight (a
    checkpoint is stored in one dtype), so the timing stores them as our kernel would."""
    shapes = {}
    for linears in groups:
        shape = _shape_of(linears)
        if shape not in shapes:
            shapes[shape] = LinearShape(*shape, bf16_exact=bf16_exact(linears[0].weight))
    return shapes


def describe_packed(model: nn.Module) -> str:
    """Which kernels run ``model``'s Linear layers, how many, and how many packed weights are bf16 (for the log)."""
    layers = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedSiblingLinear))]
    if not layers:
        return "torch"
    kernels = Counter((m.kernel if isinstance(m, PackedLinear) else m.shared.kernel).name for m in layers)
    packed = [getattr(m, "packed_weight", None) for m in layers]  # one per packed (fused) weight
    tensors = [t for p in packed if p is not None for t in (p if isinstance(p, tuple) else (p,))]
    stored_bf16 = sum(1 for t in tensors if t.dtype == torch.bfloat16 and not t.is_mkldnn)
    second = sum(t.numel() * t.element_size() for p in packed if isinstance(p, tuple) for t in p[1:])
    used = ", ".join(f"{name}: {count}" for name, count in kernels.most_common())
    extra = f", {second / 2**20:.0f} MB in second copies" if second else ""
    return f"{used} ({len(layers)} layers prepacked, {stored_bf16} weights stored as bf16{extra})"


def _sibling_groups(parent: nn.Module) -> list[tuple[tuple[str, ...], list[nn.Linear]]]:
    """``parent``'s sibling projections that can be packed as one weight (names, linears)."""
    groups = []
    for names in SIBLING_PROJECTIONS:
        linears = [getattr(parent, name, None) for name in names]
        if _fusable(linears):
            groups.append((names, linears))
    return groups


def _fusable(linears: list) -> bool:
    return (
        all(_packable(linear) for linear in linears)
        and len({linear.in_features for linear in linears}) == 1
        and len({linear.bias is None for linear in linears}) == 1
    )


def _release_checkpoint_mapping(model: nn.Module) -> None:
    """Copy the remaining CPU tensors out of the checkpoint's memory map, so the map can be closed.

    transformers maps an fp32 safetensors checkpoint into memory as is. The dense Linear weights we
    just replaced live in that map, and any tensor still viewing it (the embedding, the norms) keeps
    every page of it resident. Copying those few tensors (mostly the embedding) lets it go: measured
    on SmolLM2-135M fp32, RSS 1862 -> 1415-1448 MB across runs (unpacked: 1321).
    """
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()  # the same Parameter object: tied modules stay tied
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "cpu" and not buffer.is_mkldnn:
                module._buffers[name] = buffer.clone()


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )
