"""The Linear-kernel micro-benchmark behind docs/engine.md's kernel table."""

import pytest

from app.bench import gemm
from app.cpu.ops import available, unavailable_reason


def test_gemm_bench_reports_every_kernel_and_row_count(monkeypatch):
    monkeypatch.setattr(gemm, "LAYERS", 2)  # the real bench streams 30 layers; two keep the test fast
    report = gemm.run_gemm_bench(batches=[1, 7], kernels=["onednn", "torch", "auto"], repeats=1)
    assert set(report["rows"]) == {1, 7}
    for rows, by_kernel in report["rows"].items():
        assert set(by_kernel) == {"onednn", "torch", "auto"}
        for figures in by_kernel.values():
            assert figures["ms"] > 0
            # the three figures describe one timing: FLOPs and bytes of 2 layers' weights over that time
            # (each figure is rounded to 0.1: in a slow, contended run that rounding matters)
            expected_gflops = figures["weight_gb_per_s"] * rows / 2
            assert abs(figures["gflops"] - expected_gflops) <= 0.01 * expected_gflops + 0.05 * (1 + rows / 2)
    assert report["weight_mb"] == round(2 * sum(n * k for n, k in gemm.LAYER_SHAPES) * 4 / 2**20)


@pytest.mark.skipif(not available(), reason=f"the avx2-bf16 route is our kernel: {unavailable_reason()}")
def test_bf16_routes_report_whether_a_row_alone_has_the_bits_it_has_in_a_batch(monkeypatch):
    monkeypatch.setattr(gemm, "LAYERS", 1)
    report = gemm.run_gemm_bench(batches=[3], kernels=["avx2-bf16", "torch-bf16"], repeats=1)
    figures = report["rows"][3]
    assert "batch_invariant" not in figures["avx2-bf16"] and isinstance(figures["torch-bf16"]["batch_invariant"], bool)


def test_batch_invariance_check_notices_a_product_whose_rows_depend_on_their_batch():
    def row_sum_leaks(inputs):  # each output row depends on the whole batch
        return [x + x.sum(0, keepdim=True) for x in inputs.values()]

    def per_row(inputs):
        return [x * 2 for x in inputs.values()]

    assert not gemm.batch_invariant(row_sum_leaks, 4)
    assert gemm.batch_invariant(per_row, 4)
