"""The step profiler behind the README's "what limits us": it runs real decode steps and sees the kernels."""

import math

import pytest

from app.bench.load import LoadSpec
from app.bench.profile_steps import run_step_profile

pytestmark = [pytest.mark.model, pytest.mark.cpu_only]  # it profiles the CPU kernels' steps


KERNEL_OPS = {"avx2": "llm_serve::linear", "onednn": "mkldnn::_linear_pointwise", "torch": "aten::mm"}


@pytest.mark.parametrize("kernel", list(KERNEL_OPS))
def test_profile_times_decode_steps_and_names_the_linear_kernel(kernel):
    from app.cpu.ops import unavailable_reason

    if kernel == "avx2" and unavailable_reason() is not None:
        pytest.skip(f"the CPU kernels cannot run here: {unavailable_reason()}")
    linear_op = KERNEL_OPS[kernel]
    report = run_step_profile(LoadSpec(prompt_words=8), batches=[1, 3], dtype="float32", steps=2,
                              kernels={"cpu_linear_kernel": kernel}, profiled_steps=1)
    assert set(report["batches"]) == {1, 3}
    for batch, row in report["batches"].items():
        assert row["step_ms"] > 0
        # both figures are rounded to 0.1 as reported: at a slow moment one row's ~4 tok/s is off by up to 1.3%
        assert row["tok_per_s"] == pytest.approx(batch * 1000 / row["step_ms"], rel=0.01, abs=0.051)
        names = [op["name"] for op in row["top_ops"]]
        assert names[0] == linear_op  # matrix multiplies dominate a decode step, through the chosen kernel
        assert not {op for other, op in KERNEL_OPS.items() if other != kernel} & set(names)


# SmolLM2-135M: 2 norms x 30 layers + the final one; RoPE in each of the 30 one-frame decoder layers
@pytest.mark.parametrize("kernel, replaced", [("norm", 61), ("rotary", 30)])
def test_kernel_pairs_times_decode_steps_with_ours_and_with_torchs(kernel, replaced):
    from app.bench.kernel_pairs import run_kernel_pairs
    from app.cpu.build import unsupported_reason

    if unsupported_reason() is not None:
        pytest.skip(f"the CPU kernels cannot run here: {unsupported_reason()}")
    report = run_kernel_pairs(LoadSpec(prompt_words=8), kernel, batches=[2], dtype="float32", pairs=2, steps=1)
    row = report["batches"][2]
    assert row["replaced"] == replaced
    assert row["ours_step_ms"] > 0 and row["torch_step_ms"] > 0
    assert math.isfinite(row["paired_saving_ms"])
