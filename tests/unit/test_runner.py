"""Runner checks that need no model."""

import pytest


def test_sliding_window_models_are_refused_beyond_their_window():
    from types import SimpleNamespace

    from app.engine.runner import check_attention_supported

    with pytest.raises(ValueError, match="sliding-window attention .*max_model_len to at most 4096"):
        check_attention_supported(SimpleNamespace(sliding_window=4096), 32768)
    check_attention_supported(SimpleNamespace(sliding_window=4096), 4096)  # within the window: exact
    check_attention_supported(SimpleNamespace(sliding_window=4096, use_sliding_window=False), 32768)  # Qwen2-style
    check_attention_supported(SimpleNamespace(), 8192)
