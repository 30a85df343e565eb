"""Our AVX2 fp32 GEMM (llm_serve::linear): exact enough, batch-invariant, thread-invariant, checked, and optional."""

import ctypes
from types import SimpleNamespace

import pytest
import torch

from app.cpu import build, linear_kernels as cpu_linear, ops
from app.cpu.linear_kernels import AVX2Kernel, OneDNNKernel, select_kernel
from tests.unit.cpu.conftest import loaded_ops, needs_kernels as needs_avx2, reset_kernels


@pytest.fixture(scope="module")
def gemm() -> SimpleNamespace:
    """The two ops under the names these tests use: pack(weight, dtype) and linear(x, packed, bias, n)."""
    library = loaded_ops()  # this host supports it (needs_avx2), so it must build
    return SimpleNamespace(pack=lambda w, dtype=torch.float32: library.pack_linear_weight(w, dtype), linear=library.linear)


def _clear_caches() -> None:
    reset_kernels()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 14, 32, 64, 300])  # every tail of the 6-row tile (13, 14, 32: as 4 + 3-4), x in several passes
# n around the 16-column panel; 132 = 8 whole panels + 4 columns: one or two rows take 6 or 2 panels at once, then the rest singly
@pytest.mark.parametrize("k, n", [(1, 1), (7, 15), (64, 16), (576, 17), (1536, 49), (576, 132)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_reference(gemm, rows, k, n, bias):
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    got = gemm.linear(x, gemm.pack(w), b, n)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


@needs_avx2
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(gemm):
    torch.manual_seed(0)
    x, w, b = torch.randn(37, 576), torch.randn(132, 576), torch.randn(132)
    packed = gemm.pack(w)
    batched = gemm.linear(x, packed, b, 132)
    for start, stop in [(0, 1), (5, 6), (3, 5), (3, 10), (30, 37), (0, 37)]:  # rows land in different tiles, tails and panel groups
        assert torch.equal(gemm.linear(x[start:stop], packed, b, 132), batched[start:stop])


@needs_avx2
def test_results_do_not_depend_on_the_thread_count(gemm):
    torch.manual_seed(0)
    x, w = torch.randn(9, 576), torch.randn(960, 576)
    packed = gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, packed, None, 960)
        torch.set_num_threads(max(2, threads))
        many = gemm.linear(x, packed, None, 960)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_avx2
def test_takes_any_leading_shape_and_strides_and_no_rows(gemm):
    torch.manual_seed(0)
    w = torch.randn(24, 40)
    packed = gemm.pack(w)
    x = torch.randn(40, 2, 3).permute(1, 2, 0)  # [2, 3, 40], not contiguous
    torch.testing.assert_close(gemm.linear(x, packed, None, 24), _reference(x, w, None))
    assert gemm.linear(torch.randn(1, 0, 40), packed, None, 24).shape == (1, 0, 24)


@needs_avx2
def test_builds_from_source_into_the_cache(monkeypatch, tmp_path):
    """The build's steps (C sources and the C++ ops file compiled, linked, put in the cache under its key, reused)
    on two small sources: the real kernels' build is what every kernel test of the session loads."""
    kernels = tmp_path / "src" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "tiny.c").write_text("int tiny_next(int x) { return x + 1; }\n")
    ops_source = tmp_path / "src" / "ops.cpp"
    ops_source.write_text('extern "C" int tiny_next(int x);\nextern "C" int tiny_twice_next(int x) { return 2 * tiny_next(x); }\n')
    monkeypatch.setattr(build, "KERNELS_DIR", kernels)
    monkeypatch.setattr(build, "OPS_SOURCE", ops_source)
    monkeypatch.setenv("LLM_SERVE_CACHE", str(tmp_path / "cache"))
    library = build.build_library()
    assert library.parent == tmp_path / "cache" / "kernels" and library.stat().st_size > 0
    assert ctypes.CDLL(str(library)).tiny_twice_next(20) == 42
    assert build.build_library() == library  # the second call reuses the build
    assert len(list(library.parent.iterdir())) == 1  # no partial files left behind
    ops_source.write_text(ops_source.read_text() + "// changed\n")
    assert build.build_library() != library  # a changed source is a new build


def test_without_a_compiler_auto_falls_back_to_onednn_and_avx2_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(build, "unsupported_reason", lambda: None)  # as on a machine that could run them
    _clear_caches()
    try:
        assert "failed" in ops.unavailable_reason()
        assert isinstance(select_kernel("auto"), OneDNNKernel)
        with pytest.raises(ValueError, match="avx2.*use auto"):
            select_kernel("avx2")
    finally:
        _clear_caches()
    assert select_kernel("torch") is None


def test_a_compiler_error_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(build, "unsupported_reason", lambda: None)
    _clear_caches()
    try:
        assert "compiling the CPU kernels failed" in ops.unavailable_reason()
        assert not ops.available()
    finally:
        _clear_caches()


@needs_avx2
def test_auto_picks_our_kernel_where_it_builds():
    assert isinstance(select_kernel("auto"), AVX2Kernel)
    with pytest.raises(ValueError, match="not one of"):
        select_kernel("mkl")
    assert cpu_linear.onednn_supported()


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 6, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_compute_in_fp32_exactly_like_the_rounded_fp32_weights(gemm, rows, bias):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576), torch.randn(132, 576)
    b = torch.randn(132) if bias else None
    rounded = w.bfloat16().float()  # what the bf16 panels hold
    packed = gemm.pack(w, torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.numel() == gemm.pack(w).numel()
    got = gemm.linear(x, packed, b, 132)
    # the same fp32 arithmetic, in the same order, as the fp32 kernel on the rounded weights: same bits
    assert torch.equal(got, gemm.linear(x, gemm.pack(rounded), b, 132))
    torch.testing.assert_close(got, _reference(x, rounded, b), rtol=1e-5, atol=1e-4)


@needs_avx2
def test_bf16_packing_rounds_as_torch_does(gemm):
    w = torch.tensor([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -3.14159, 1e-40, float("inf"), -0.0, 65504.0, 3.0e38]])  # ties, denormal, inf
    packed = gemm.pack(w, torch.bfloat16)
    assert torch.equal(packed.view(-1, 16)[:8, 0], w[0].bfloat16())  # panel layout: k-major, 16 columns


@needs_avx2
def test_an_fp32_weight_of_bf16_values_is_stored_as_bf16_with_the_same_bits_out(gemm):
    kernel = AVX2Kernel()  # fp32 weights, as `dtype: auto` loads a bf16 checkpoint on this CPU
    bf16_valued = torch.randn(40, 24).to(torch.bfloat16).float()
    packed = kernel.pack(bf16_valued)
    assert packed.dtype == torch.bfloat16 and packed.numel() == gemm.pack(bf16_valued).numel()
    x = torch.randn(7, 24)
    as_fp32 = gemm.linear(x, gemm.pack(bf16_valued, torch.float32), None, 40)
    assert torch.equal(kernel.apply(x, packed, None, 40), as_fp32)


@needs_avx2
def test_an_fp32_weight_with_finer_values_stays_fp32(gemm):
    weight = torch.randn(40, 24).to(torch.bfloat16).float()
    weight[3, 5] += 2.0**-20  # one value bf16 cannot hold
    assert AVX2Kernel().pack(weight).dtype == torch.float32
    assert not cpu_linear.bf16_exact(weight)


def test_our_bf16_kernel_asked_for_where_it_cannot_run_is_an_error_saying_why(monkeypatch):
    import pytest

    monkeypatch.setattr(cpu_linear, "bf16_products_available", lambda: False)
    monkeypatch.setattr(cpu_linear, "unavailable_reason", lambda: None)
    with pytest.raises(ValueError, match="avx512-bf16, but this CPU has no avx512_bf16; use auto"):
        cpu_linear.select_kernel("avx512-bf16")
    with pytest.raises(ValueError, match="avx512-bf16"):
        cpu_linear.select_kernel("auto", bf16_products=True)  # the loader never asks for it there; if it did, it is said
