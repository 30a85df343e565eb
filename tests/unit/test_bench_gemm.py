"""The Linear-kernel micro-benchmark behind docs/engine.md's kernel table."""

from app.bench import gemm


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
