"""Runner checks that need no model."""

from types import SimpleNamespace

from app.engine.runner import uniform_sliding_window


def test_uniform_sliding_window_only_where_every_layer_slides():
    assert uniform_sliding_window(SimpleNamespace(sliding_window=4096)) == 4096  # Mistral
    assert uniform_sliding_window(SimpleNamespace(sliding_window=4096, use_sliding_window=False)) is None  # Qwen2 off
    both = ["sliding_attention", "full_attention"]
    assert uniform_sliding_window(SimpleNamespace(sliding_window=64, layer_types=both)) is None  # Gemma 2/3
    assert uniform_sliding_window(SimpleNamespace(sliding_window=64, layer_types=["sliding_attention"] * 3)) == 64
    assert uniform_sliding_window(SimpleNamespace(sliding_window=None)) is None
    assert uniform_sliding_window(SimpleNamespace()) is None
