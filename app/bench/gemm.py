"""Linear kernels head to head on a model's own matrix shapes: ``python -m app.bench gemm``.

For each row count (``--batches``: sequences in a decode step, or tokens in a prefill chunk) it runs
the projections of every decoder layer of SmolLM2-135M (q/k/v fused, o, gate/up fused, down; 30
layers of distinct random weights, 425 MB, so they stream from memory as in a real step, not from
cache) through each CPU Linear kernel the engine can use, alternating kernels, and reports the time
per pass, GFLOP/s and the fp32 weight bytes per second (``avx2-bf16``, bf16 weights, reads half of
them). The figures in docs/engine.md come from here. A kernel name with ``+2mb`` (``avx512-bf16+2mb``) runs that
kernel on weights the engine's way, collapsed into 2 MB pages (app/engine/host_memory.py), beside the same kernel on
weights where malloc left them (4 KB pages unless the machine's huge pages are set to ``always``).

The library's bf16 routes run beside them for the bake-off a bf16-compute kernel needs first
(docs/performance.md): ``onednn-bf16`` (oneDNN's packed bf16 weights and bf16 activations: ``vdpbf16ps``
where the CPU has avx512_bf16) and ``torch-bf16`` (``F.linear`` in bf16). Both round the activations to bf16,
so they are a different model numerically, as is our own bf16 kernel (``avx512-bf16``); for each of these the
report says whether a row computed alone has the same bits as inside a batch of ``rows``
(``batch_invariant``), which the engine's bit-exact batching needs.

The 4-bit routes (``app/cpu/int4_kernels.py``) take the same shapes as GPTQ layers (random weights quantized to
4-bit codes, a zero and an fp16 scale per group of 32 inputs and column): ``torch-int4`` is torch's
``_weight_int4pack_mm_for_cpu`` as GPTQModel calls it on CPU, ``int4-avx512-bf16`` ours (CPUs with avx512_bf16),
``dequant-fp32`` / ``dequant-bf16`` the weight rebuilt at each call and one dense product:
``--kernels torch-int4 dequant-fp32``.
"""

from __future__ import annotations

import time

import torch

from app.cpu.linear_kernels import select_kernel
from app.engine.host_memory import back_with_huge_pages, tensor_spans

HUGE_PAGES = "+2mb"  # a kernel name with this suffix: its packed weights collapsed into 2 MB pages, the engine's way
LAYERS = 30
# (out_features, in_features) of one SmolLM2-135M decoder layer, siblings fused as the engine runs them
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
_ROUNDS = 3


def run_gemm_bench(batches: list[int], kernels: list[str], repeats: int = 5) -> dict:
    torch.manual_seed(0)
    weights = [torch.randn(*shape) for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    packed = {name: _pack(name, weights) for name in kernels}
    report: dict = {"threads": torch.get_num_threads(), "weight_mb": round(weight_bytes / 2**20), "rows": {}}
    for rows in batches:
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        best = {name: min(_time(fn, inputs, repeats) for _ in range(_ROUNDS)) for name, fn in packed.items()}
        report["rows"][rows] = {
            name: {"ms": round(s * 1000, 2), "gflops": round(2 * rows * weight_bytes / 4 / s / 1e9, 1),
                   "weight_gb_per_s": round(weight_bytes / s / 1e9, 1)}
            for name, s in best.items()
        }
        for name in (BF16_ROUTES.keys() | {"avx512-bf16"}) & packed.keys():
            report["rows"][rows][name]["batch_invariant"] = batch_invariant(packed[name], rows)
        print(f"{rows:4d} rows: " + " | ".join(f"{n} {r['ms']:7.2f} ms {r['gflops']:6.1f} GFLOP/s {r['weight_gb_per_s']:5.1f} GB/s{_invariance(r)}"
                                              for n, r in report["rows"][rows].items()), flush=True)
    return report


def _pack(name: str, weights: list[torch.Tensor]):
    if name in BF16_ROUTES:
        return BF16_ROUTES[name](weights)
    # "avx2-bf16": our kernel with bf16 weights (what dtype bfloat16 runs on a CPU without native bf16)
    base, huge = name.removesuffix(HUGE_PAGES), name.endswith(HUGE_PAGES)
    kernel = select_kernel("avx2", torch.bfloat16) if base == "avx2-bf16" else select_kernel(base)
    if kernel is None:  # torch's own kernels on the dense weights
        return lambda inputs: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights]
    packed = [(kernel.pack(w), w.shape[0], w.shape[1]) for w in weights]
    if huge:  # as the engine keeps its weights (app/engine/host_memory.py); the others stay where malloc put them
        done, why = back_with_huge_pages(tensor_spans([p for p, _, _ in packed]))
        print(f"{name}: {done / 2**20:.0f} MB of packed weights in 2 MB pages{f' ({why})' if why else ''}", flush=True)
    return lambda inputs: [kernel.apply(inputs[k], p, None, n) for p, n, k in packed]


def _invariance(figures: dict) -> str:
    if "batch_invariant" not in figures:
        return ""
    return " (rows alone = in batch)" if figures["batch_invariant"] else " (rows alone != in batch)"


def _onednn_bf16(weights: list[torch.Tensor]):
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32), w.shape[1]) for w in weights]
    return lambda inputs: [torch.ops.mkldnn._linear_pointwise(inputs[k].bfloat16(), p, None, "none", [], "") for p, k in packed]


def _torch_bf16(weights: list[torch.Tensor]):
    dense = [w.bfloat16() for w in weights]
    return lambda inputs: [torch.nn.functional.linear(inputs[w.shape[1]].bfloat16(), w) for w in dense]


def _int4_route(name: str):
    """A 4-bit kernel of ``int4_kernels.py`` on GPTQ-like layers of the same shapes (random codes, a zero and an fp16
    scale per group of 32 inputs and column)."""

    def pack(weights: list[torch.Tensor]):
        from app.cpu.int4_kernels import Int4Weights, available_int4_kernels

        kernel = available_int4_kernels().get(name)
        if kernel is None:
            raise SystemExit(f"{name} does not run on this CPU or torch build")
        layers = [(kernel.pack(Int4Weights.from_dense(w, 32)), w.shape[0], w.shape[1]) for w in weights]
        return lambda inputs: [kernel.apply(inputs[k], packed, None, n) for packed, n, k in layers]

    return pack


INT4_ROUTES = ("int4-avx512-bf16", "torch-int4", "dequant-fp32", "dequant-bf16")
BF16_ROUTES = {"onednn-bf16": _onednn_bf16, "torch-bf16": _torch_bf16, **{name: _int4_route(name) for name in INT4_ROUTES}}


def batch_invariant(fn, rows: int) -> bool:
    """Whether every row of a ``rows``-row product has the same bits computed alone (all layers)."""
    inputs = {k: torch.randn(rows, k) for k in {in_features for _, in_features in LAYER_SHAPES}}
    together = fn(inputs)
    for row in range(rows):
        alone = fn({k: x[row : row + 1] for k, x in inputs.items()})
        if any(not torch.equal(a[0], t[row]) for a, t in zip(alone, together)):
            return False
    return True


def _time(fn, inputs, repeats: int) -> float:
    fn(inputs)
    started = time.perf_counter()
    for _ in range(repeats):
        fn(inputs)
    return (time.perf_counter() - started) / repeats
