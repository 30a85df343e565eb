"""The context an architecture is served exactly to (app/models/exact_context.py), and the layers the paged KV pool
cannot hold (app/engine/runner.py), from transformers' own configs."""

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, Llama4TextConfig, Phi3Config, Qwen2Config

from app.engine.runner import _require_steps_within_the_packed_limit
from app.models.exact_context import asked_past_stated_context, exact_context_limit, rope_scaled_context


def test_most_architectures_have_no_limit():
    assert exact_context_limit(LlamaConfig()) is None
    assert exact_context_limit(LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192})) is None
    assert exact_context_limit(Gemma3TextConfig()) is None  # rope settings per layer type, none of them longrope


def test_longrope_holds_to_its_original_context():
    config = Phi3Config(original_max_position_embeddings=4096, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 48,
                                         "long_factor": [2.0] * 48})
    tokens, why = exact_context_limit(config)
    assert tokens == 4096 and "longrope" in why


def test_llama4_holds_to_its_attention_chunk_and_below_its_temperature_tuning():
    tokens, why = exact_context_limit(Llama4TextConfig(attention_chunk_size=8192, floor_scale=8192))
    assert (tokens, why.startswith("query temperature tuning")) == (8191, True)
    assert exact_context_limit(Llama4TextConfig(attention_chunk_size=1024, floor_scale=8192))[0] == 1024
    _require_steps_within_the_packed_limit(Llama4TextConfig(floor_scale=8192), 2048)
    with pytest.raises(ValueError, match="engine.max_num_batched_tokens 8192 is past the 8191 tokens one step"):
        _require_steps_within_the_packed_limit(Llama4TextConfig(floor_scale=8192), 8192)



def test_yarn_extends_the_context_to_its_original_length_times_its_factor():
    """Qwen2.5's long-context setting (config.json gains YaRN, max_position_embeddings stays 32768): 131072, as vLLM
    derives; DeepSeek-V3's form (the extended length already stated) stays; dynamic NTK, linear and none: no change."""
    qwen = Qwen2Config(max_position_embeddings=32768, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    tokens, how = rope_scaled_context(qwen, 32768)
    assert tokens == 131072 and how == "YaRN rope scaling, factor 4 over 32768 positions"
    implied = LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    assert rope_scaled_context(implied, 4096)[0] == 8192  # the original is the stated context
    stated = LlamaConfig(max_position_embeddings=163840, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                                                                          "original_max_position_embeddings": 4096})
    assert rope_scaled_context(stated, 163840) is None
    for rope in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 8.0}, None):
        config = LlamaConfig(max_position_embeddings=4096, rope_parameters=rope and {**rope, "rope_theta": 1e4})
        assert rope_scaled_context(config, 4096) is None
    assert rope_scaled_context(qwen, None) is None


def test_a_longer_context_asked_for_is_taken_up_to_a_linear_factor_and_never_past_dynamic_ntk():
    linear = LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})
    assert asked_past_stated_context(linear, 4096)[0] == 16384  # LongChat's and Vicuna-16k's configs
    dynamic = LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    ceiling, why = asked_past_stated_context(dynamic, 4096)
    assert ceiling is None and "dynamic NTK" in why
    assert asked_past_stated_context(LlamaConfig(), 4096) is None

@pytest.mark.parametrize("config, message", [
    ("DeepseekV3Config", "DeepseekV3Config cannot be served: it uses multi-head latent attention"),
    ("Qwen3NextConfig", r"Qwen3NextConfig cannot be served: it has linear_attention layers \(layer 0, 1, 2,"),
    ("Gemma4TextConfig", "Gemma4TextConfig cannot be served: its attention layers have head sizes of their own"),
    ("RwkvConfig", "RwkvConfig cannot be served: its config states no num_attention_heads"),
])
def test_layers_the_paged_pool_cannot_hold_are_refused_by_name(config, message):
    """Refused when the engine is built, before any forward: the message names the architecture and what it has."""
    import transformers

    from app.engine.runner import KVCacheShape, UnsupportedArchitectureError

    fields = {"head_dim": 16, "global_head_dim": 32} if config == "Gemma4TextConfig" else {}
    with pytest.raises(UnsupportedArchitectureError, match=message):
        KVCacheShape.of(getattr(transformers, config)(**fields))
    assert KVCacheShape.of(LlamaConfig(hidden_size=64, num_attention_heads=4)).head_dim == 16


def test_a_model_of_non_attention_layers_is_refused_by_what_it_is_before_its_context_or_weights(tmp_path):
    """Mamba states no context length: the refusal names its layers, not the missing max_model_len."""
    from transformers import MambaConfig

    from app.config import ModelConfig
    from app.engine.runner import UnsupportedArchitectureError
    from app.models import load_model

    config = MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=300)
    config.architectures = ["MambaForCausalLM"]
    config.save_pretrained(tmp_path)  # no weights, no tokenizer: refused from the config alone
    with pytest.raises(UnsupportedArchitectureError, match="MambaForCausalLM cannot be served: it has linear_attention layers"):
        load_model(ModelConfig(source=str(tmp_path), dtype="float32"))


def test_a_config_that_cannot_be_read_is_the_loads_own_error_naming_it(tmp_path):
    from app.config import ModelConfig
    from app.models import load_model
    from app.models.loader import ModelLoadError

    (tmp_path / "config.json").write_text('{"model_type": "llama",\n"hidden_size": 64 "x": 1}')
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        load_model(ModelConfig(source=str(tmp_path), dtype="float32"))
