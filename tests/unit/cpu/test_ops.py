"""The kernels as torch ops: arguments checked at the boundary, and traceable by torch.compile."""

import pytest
import torch

from tests.unit.cpu.conftest import loaded_ops, needs_kernels

pytestmark = needs_kernels


@pytest.fixture(scope="module")
def ops():
    return loaded_ops()


def test_linear_refuses_wrong_dtypes_devices_and_shapes_with_a_message(ops):
    packed = ops.pack_linear_weight(torch.randn(24, 40), torch.float32)
    x = torch.randn(3, 40)
    cases = {
        "x must be Float": (x.double(), packed, None, 24),
        "packed holds no": (torch.randn(3, 41), packed, None, 24),
        "bias must have 24": (x, packed, torch.randn(23), 24),
        "packed must be float32 or bfloat16": (x, packed.half(), None, 24),
    }
    for message, args in cases.items():
        with pytest.raises(RuntimeError, match=message):
            ops.linear(*args)
    with pytest.raises(RuntimeError, match="packed weights are float32 or bfloat16"):
        ops.pack_linear_weight(torch.randn(4, 4), torch.float16)


def test_attention_refuses_layouts_it_would_misread(ops):
    query, key = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8)
    pool = torch.zeros(16, 2, 8)
    slots, counts = torch.tensor([[0, 1], [2, 3]]), torch.tensor([2, 2])
    new = torch.tensor([1, 3])
    with pytest.raises(RuntimeError, match="k_pool must be"):
        ops.decode_attention(query, key, key, torch.zeros(16, 3, 8), pool, new, slots, counts, 0.3)
    with pytest.raises(RuntimeError, match="key_counts\\[1\\] must be in 1..2"):
        ops.decode_attention(query, key, key, pool, pool.clone(), new, slots, torch.tensor([2, 3]), 0.3)
    with pytest.raises(RuntimeError, match="new_slots\\[0\\] is outside the pool"):
        ops.decode_attention(query, key, key, pool, pool.clone(), torch.tensor([16, 3]), slots, counts, 0.3)
    with pytest.raises(RuntimeError, match="key_slots must be Long"):
        ops.prefill_attention(query, pool, pool, slots.int(), torch.tensor([0, 1]), torch.tensor([1, 2]), 0.3)
    with pytest.raises(RuntimeError, match="query_seq\\[1\\] names no row"):
        ops.prefill_attention(query, pool, pool, slots, torch.tensor([0, 2]), torch.tensor([1, 2]), 0.3)


def test_norm_rotary_and_argmax_check_their_inputs(ops):
    with pytest.raises(RuntimeError, match="last dimension must equal"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="must be a CPU tensor|must be Float"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-5)
    q, k, cos = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 3, 4)
    with pytest.raises(RuntimeError, match="partial rotary"):
        ops.rotary(q, k, cos, cos)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.argmax_rows(torch.randn(4, 6).t())


def test_the_ops_trace_under_torch_compile_and_give_the_eager_results(ops):
    weight, norm_weight = torch.randn(32, 16), torch.randn(16)
    packed = ops.pack_linear_weight(weight, torch.float32)
    angles = torch.rand(1, 5, 8)

    def block(x):  # [5, 16]
        h = ops.rms_norm(x, norm_weight, 1e-5)
        y = ops.linear(h, packed, None, 32)  # [5, 32]
        q = y.view(1, 5, 4, 8).transpose(1, 2)
        q, k = ops.rotary(q, q[:, :2], angles.cos(), angles.sin())
        return ops.argmax_rows(q.reshape(-1, 8).contiguous()), k

    x = torch.randn(5, 16)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # traces through the fake implementations
    for got, expected in zip(compiled(x), block(x)):
        assert torch.equal(got, expected)


def test_loading_again_after_a_reset_registers_no_second_fake(ops, monkeypatch):
    """Tests turn the kernels off and on (the load cache cleared); some torch releases refuse a second fake for an
    op, so the second load must not register them again."""
    from app.cpu import ops as cpu_ops

    def refuse(name, *args, **kwargs):
        raise RuntimeError(f"register_fake({name}): an fake impl is already registered")

    monkeypatch.setattr(torch.library, "register_fake", refuse)
    cpu_ops.load_ops.cache_clear()
    try:
        assert cpu_ops.load_ops() is None
    finally:
        cpu_ops.load_ops.cache_clear()
