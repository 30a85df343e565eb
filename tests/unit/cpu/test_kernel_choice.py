"""The Linear kernel bake-off: the decision on fake timings, the row routing, every candidate against torch on every
row bucket, and the batch-invariant mode (where decisions are kept, and when a timing counts: test_kernel_choice_cache.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.cpu import kernel_choice
from app.cpu.kernel_choice import BUCKETS, ChoiceCache, LinearShape, capped_at_more_rows, choose, decide
from app.cpu.linear import PackedLinear, describe_packed, pack_cpu_linears
from app.cpu.linear_kernels import (
    AVX2Kernel,
    AVX512BF16Kernel,
    OneDNNBF16Kernel,
    OneDNNKernel,
    RowBucketKernel,
    TorchKernel,
    bf16_products_available,
    onednn_bf16_supported,
    onednn_supported,
)
from app.cpu.ops import available, unavailable_reason


def test_a_challenger_replaces_the_incumbent_only_beyond_the_margin():
    times = {"1": {"ours": 1.00, "lib": 0.95},  # 5% faster: noise, the incumbent stays
             "2-8": {"ours": 1.00, "lib": 0.85},  # 15% faster: taken
             "9-64": {"ours": 1.00, "lib": 1.30},
             "65+": {"ours": 1.00, "lib": 0.89}}  # just past the margin: taken
    assert decide(times, "ours", margin=0.10, min_gain_s=0) == {"1": "ours", "2-8": "lib", "9-64": "ours", "65+": "lib"}


def test_a_gain_too_small_to_measure_keeps_the_incumbent():
    times = {"1": {"ours": 3e-6, "lib": 1e-6}}  # 3x faster, but by 2 us a call: call overhead and noise
    assert decide(times, "ours", margin=0.10, min_gain_s=5e-6) == {"1": "ours"}
    assert decide({"1": {"ours": 3e-3, "lib": 1e-3}}, "ours") == {"1": "lib"}


def test_without_the_incumbent_the_fastest_is_taken():
    assert decide({"1": {"a": 2.0, "b": 1.5, "c": 1.9}}, "ours") == {"1": "b"}



# As timed on an idle AMX machine with oneDNN's AMX turned off: our kernel's one-row pass came out at 739 us, its
# four-row pass at 307 (a disturbed timing: fewer rows over the same weights take no longer).
DISTURBED = {"1": {"ours": 739e-6, "lib": 646e-6}, "2-8": {"ours": 307e-6, "lib": 388e-6},
             "9-64": {"ours": 2422e-6, "lib": 2496e-6}, "65+": {"ours": 23610e-6, "lib": 23593e-6}}


def test_the_incumbents_time_at_fewer_rows_is_capped_by_its_time_at_more_rows():
    assert decide(DISTURBED, "ours")["1"] == "lib"  # the disturbed timing alone flips the bucket
    capped = capped_at_more_rows(DISTURBED, "ours")
    assert capped["1"] == {"ours": 307e-6, "lib": 646e-6}
    assert {bucket: capped[bucket] for bucket in ("2-8", "9-64", "65+")} == {b: DISTURBED[b] for b in ("2-8", "9-64", "65+")}
    assert decide(capped, "ours") == dict.fromkeys(DISTURBED, "ours")


def test_the_cap_never_promotes_a_challenger():
    times = {"1": {"ours": 100e-6, "lib": 80e-6}, "2-8": {"ours": 120e-6, "lib": 20e-6},
             "9-64": {"ours": 400e-6, "lib": 60e-6}, "65+": {"ours": 3000e-6, "lib": 500e-6}}
    capped = capped_at_more_rows(times, "ours")
    assert capped == times  # consistent times are left alone, the challenger's above all
    assert decide(capped, "ours") == {"1": "lib", "2-8": "lib", "9-64": "lib", "65+": "lib"}


def test_a_bake_off_decides_on_capped_times_and_caches_them_as_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr(kernel_choice, "time_candidates", lambda shape, kernels: DISTURBED)
    cache = ChoiceCache(tmp_path / "choices.json")
    shape = LinearShape(96, 64)
    assert choose([shape], {"ours": None, "lib": None}, "ours", "fp32", None, cache) == {shape.key: dict.fromkeys(DISTURBED, "ours")}
    saved = next(iter(cache._read().values()))
    assert next(iter(saved.values()))[shape.key]["us"]["1"] == {"ours": 739.0, "lib": 646.0}


def test_a_cached_decision_is_decided_again_by_todays_rule_without_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    cache = ChoiceCache(tmp_path / "choices.json")
    shape = LinearShape(96, 64)
    stale = {"choice": {"1": "lib", "2-8": "ours", "9-64": "ours", "65+": "ours"}, "measured": "2026-11-26 10:52",
             "us": {bucket: {name: round(t * 1e6, 1) for name, t in by_kernel.items()} for bucket, by_kernel in DISTURBED.items()}}
    cache.put(kernel_choice.machine_key(None), "fp32, rows 1/4/32/256", {shape.key: stale})

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached decision was timed again")

    monkeypatch.setattr(kernel_choice, "time_candidates", no_timing)
    assert choose([shape], {"ours": None, "lib": None}, "ours", "fp32", None, cache) == {shape.key: dict.fromkeys(DISTURBED, "ours")}


def test_buckets_cover_every_row_count_once():
    for rows in [1, 2, 8, 9, 64, 65, 4096]:
        assert sum(bucket.holds(rows) for bucket in BUCKETS) == 1
    assert [bucket.name for bucket in BUCKETS] == ["1", "2-8", "9-64", "65+"]
    assert all(bucket.holds(bucket.timed) for bucket in BUCKETS)


class Tagged:
    """A fake kernel whose output says which kernel ran: ``tag`` in every element."""

    def __init__(self, name: str, tag: float) -> None:
        self.name, self.tag = name, tag

    def pack(self, weight):
        return weight.clone()

    def apply(self, x, packed, bias, out_features):
        return torch.full((*x.shape[:-1], out_features), self.tag)


def test_row_counts_go_to_their_buckets_kernel():
    small, large = Tagged("small", 1.0), Tagged("large", 2.0)
    kernel = RowBucketKernel([(BUCKETS[0], small), (BUCKETS[1], small), (BUCKETS[2], large), (BUCKETS[3], small)])
    assert kernel.name == "small 1-8 rows / large 9-64 rows / small 65+ rows"
    packed = kernel.pack(torch.zeros(4, 4))
    assert len(packed) == 2  # one copy per distinct kernel
    for rows, tag in [(1, 1.0), (8, 1.0), (9, 2.0), (64, 2.0), (65, 1.0), (3000, 1.0)]:
        assert kernel.apply(torch.zeros(1, rows, 4), packed, None, 4).unique().item() == tag, rows
        residual = torch.full((1, rows, 4), 10.0)  # a kernel without apply_add: the sum after its product
        assert kernel.apply_add(torch.zeros(1, rows, 4), packed, None, 4, residual).unique().item() == 10.0 + tag, rows


class Slow:
    """A candidate that is correct and always slower than torch's own (it runs torch's twice)."""

    name = "slow"

    def pack(self, weight):
        return weight.clone()

    def apply(self, x, packed, bias, out_features):
        F.linear(x, packed, bias)
        return F.linear(x, packed, bias)


def test_a_decision_is_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)  # products this small may not keep every thread busy
    cache = ChoiceCache(tmp_path / "choices.json")
    shapes = [LinearShape(96, 64), LinearShape(128, 64, bf16_exact=True)]
    kernels = {"slow": Slow(), "torch": TorchKernel()}
    first = choose(shapes, kernels, "slow", "fp32", None, cache)
    assert set(first) == {shape.key for shape in shapes}
    assert all(set(choice) == {b.name for b in BUCKETS} and set(choice.values()) <= set(kernels) for choice in first.values())

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached decision was timed again")

    monkeypatch.setattr(kernel_choice, "time_candidates", no_timing)
    assert choose(shapes, kernels, "slow", "fp32", None, ChoiceCache(cache.path)) == first  # a restart: no timing
    with pytest.raises(AssertionError):  # another machine (here: another kernel build) measures its own
        choose(shapes, kernels, "slow", "fp32", "another-build", cache)


def _candidates() -> list:
    """(kernel, tolerance, why it is absent) for every candidate, on every CPU."""
    reason = unavailable_reason()
    return [
        pytest.param(AVX2Kernel, 1e-5, marks=pytest.mark.skipif(not available(), reason=f"our kernels: {reason}"), id="avx2"),
        pytest.param(OneDNNKernel, 1e-5, marks=pytest.mark.skipif(not onednn_supported(), reason="no oneDNN in this torch"), id="onednn"),
        pytest.param(TorchKernel, 1e-6, id="torch"),
        pytest.param(AVX512BF16Kernel, 2e-2, marks=pytest.mark.skipif(not bf16_products_available(), reason="no avx512_bf16"), id="avx512-bf16"),
        pytest.param(OneDNNBF16Kernel, 2e-2, marks=pytest.mark.skipif(not onednn_bf16_supported(), reason="no oneDNN bf16 path"), id="onednn-bf16"),
    ]


@pytest.mark.parametrize("kernel, tolerance", _candidates())
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 72)])
def test_every_candidate_computes_torchs_linear_on_every_bucket(kernel, tolerance, shape):
    torch.manual_seed(0)
    weight, bias = torch.randn(*shape) / shape[1] ** 0.5, torch.randn(shape[0])
    kernel = kernel()
    packed = kernel.pack(weight)
    for bucket in BUCKETS:
        for rows in {bucket.low, bucket.timed}:
            x = torch.randn(rows, shape[1])
            torch.testing.assert_close(kernel.apply(x, packed, bias, shape[0]), F.linear(x, weight, bias),
                                       rtol=tolerance, atol=tolerance)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 80))


@pytest.mark.skipif(not available(), reason=f"our kernels: {unavailable_reason()}")
def test_in_batch_invariant_mode_rows_have_the_same_bits_alone_and_in_a_batch_of_64():
    model = _model()
    pack_cpu_linears(model, "auto", batch_invariant=True)
    assert {m.kernel.name for m in model if isinstance(m, PackedLinear)} == {"avx2"}
    batch = torch.randn(64, 64)
    with torch.inference_mode():
        together = model(batch)
        assert all(torch.equal(model(batch[i : i + 1])[0], together[i]) for i in (0, 37, 63))


def test_auto_mixes_kernels_where_the_bake_off_says_and_keeps_torchs_results(monkeypatch):
    choice = {"1": "torch", "2-8": "torch", "9-64": "slow", "65+": "slow"}
    monkeypatch.setattr("app.cpu.linear.bake_off_candidates", lambda *args: {"torch": TorchKernel(), "slow": Slow()})
    monkeypatch.setattr(kernel_choice, "choose", lambda shapes, *args: {shape.key: choice for shape in shapes})
    dense, packed = _model(), _model()
    assert pack_cpu_linears(packed, "auto") == 2
    assert "torch 1-8 rows / slow 9+ rows: 2" in describe_packed(packed)
    assert "MB in second copies" in describe_packed(packed)
    with torch.inference_mode():
        for rows in (1, 8, 9, 200):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(packed(x), dense(x))


def test_batch_invariant_refuses_a_kernel_that_sums_by_batch():
    if not onednn_supported():
        pytest.skip("no oneDNN in this torch")
    with pytest.raises(ValueError, match="batch_invariant needs a fixed-order kernel"):
        pack_cpu_linears(_model(), "onednn", batch_invariant=True)


@pytest.mark.skipif(not available(), reason=f"our kernels: {unavailable_reason()}")
def test_with_bf16_weights_every_candidate_computes_on_the_same_rounded_weights():
    from app.cpu.linear_kernels import bake_off_candidates

    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    rounded = weight.to(torch.bfloat16).float()
    candidates = bake_off_candidates(False, torch.bfloat16)
    assert "avx2-bf16-weights" in candidates and "torch-bf16-weights" in candidates
    for rows in (1, 40, 300):
        x = torch.randn(rows, 64)
        for kernel in candidates.values():
            torch.testing.assert_close(kernel.apply(x, kernel.pack(weight), None, 96), F.linear(x, rounded), rtol=1e-5, atol=1e-5)


def test_a_timing_disturbed_by_other_work_keeps_the_incumbent_and_is_not_cached(tmp_path, monkeypatch):
    cache = ChoiceCache(tmp_path / "choices.json")
    shapes = [LinearShape(96, 64)]
    fast_wins = {b.name: {"ours": 1.0, "lib": 0.5} for b in BUCKETS}  # the challenger twice as fast everywhere
    monkeypatch.setattr(kernel_choice, "time_candidates", lambda shape, kernels: fast_wins)
    monkeypatch.setattr(kernel_choice.time, "process_time", lambda: 0.0)  # the timing got none of the CPU
    kernels = {"ours": TorchKernel(), "lib": Slow()}
    assert choose(shapes, kernels, "ours", "fp32", None, cache) == {shapes[0].key: {b.name: "ours" for b in BUCKETS}}
    assert cache.get(kernel_choice.machine_key(None), "fp32, rows 1/4/32/256", shapes[0].key) is None  # timed again next start
    assert not cache.path.exists()


def test_a_candidate_that_fails_here_is_left_out_of_the_timing():
    class Broken(TorchKernel):
        def apply(self, *args, **kwargs):
            raise RuntimeError("this op is not built for this CPU")

    times = kernel_choice.time_candidates(LinearShape(32, 16), {"torch": TorchKernel(), "broken": Broken()},
                                          buckets=BUCKETS[:1])
    assert set(times[BUCKETS[0].name]) == {"torch"}
