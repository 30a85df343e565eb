"""Our row-wise argmax (llm_serve::argmax_rows): torch.argmax's answers exactly, ties and NaN included."""

import pytest
import torch

from app.cpu.argmax import argmax_rows
from tests.unit.cpu.conftest import loaded_ops, needs_kernels


def KERNEL(x):
    return loaded_ops().argmax_rows(x)  # this machine supports the kernels: a failed build fails these tests


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100, 49152])  # around the 8-wide vectors and the scalar path
@pytest.mark.parametrize("rows", [1, 5])
def test_equals_torch_on_random_rows(rows, n):
    x = torch.randn(rows, n)
    assert torch.equal(KERNEL(x), x.argmax(dim=-1))


@needs_kernels
def test_ties_go_to_the_first_index_in_any_lane_and_in_the_tail():
    x = torch.zeros(6, 1003)
    x[0, [6, 13]] = 3.0  # lane 6 holds index 6, lane 5 index 13: the lanes' reduction must pick 6
    x[1, [5, 13, 21]] = 2.0  # three in one lane: the first stays
    x[2, [1000, 1002]] = 1.0  # in the scalar tail
    x[3, [7, 1001]] = 1.0  # one in the vectors, one in the tail
    x[4] = float("-inf")  # all equal: index 0
    x[5, [8, 16]] = -0.0  # -0 == +0: still the first of the equal zeros
    assert torch.equal(KERNEL(x), x.argmax(dim=-1))
    assert KERNEL(x).tolist()[:5] == [6, 5, 1000, 7, 0]


@needs_kernels
@pytest.mark.parametrize("at", [0, 3, 9, 500, 1001])
def test_a_nan_wins_at_its_first_index_as_in_torch(at):
    x = torch.randn(2, 1003)
    x[0, at] = float("nan")
    x[0, 1002] = float("nan")  # a later NaN does not move it
    x[1, 50] = float("inf")
    assert torch.equal(KERNEL(x), x.argmax(dim=-1))


@needs_kernels
def test_rows_are_independent_of_the_batch_and_thread_count():
    x = torch.randn(9, 4096)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(KERNEL(x), one) and torch.equal(KERNEL(x[3:4]), one[3:4])
    finally:
        torch.set_num_threads(threads)


def test_inputs_it_does_not_serve_go_to_torch():  # on every machine
    x = torch.randn(3, 40)
    for other in (x.double(), x.t(), x[:, ::2], x.bfloat16()):
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))


def test_with_the_kernels_off_it_is_torch_argmax(kernels_off):
    x = torch.randn(4, 100)
    x[1, 7] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
