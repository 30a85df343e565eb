"""Which transformers class loads a checkpoint (app/models/loader.py ``_model_class``), from its config alone: a causal
LM, an image-text-to-text model whose text decoder runs alone, or a refusal naming why, before any weight is read."""

import pytest
import transformers

from app.models.loader import ModelLoadError, _model_class
from app.models.unread_weights import unread_weights


@pytest.mark.parametrize("config, expected", [
    (transformers.LlamaConfig(), "AutoModelForCausalLM"),
    (transformers.Gemma3Config(), "AutoModelForCausalLM"),  # transformers registers it as a causal LM too
    (transformers.Mistral3Config(), "AutoModelForImageTextToText"),  # Mistral Small 3.1: image-text-to-text alone
    (transformers.Qwen2_5_VLConfig(), "AutoModelForImageTextToText"),
    (transformers.LlavaConfig(), "AutoModelForImageTextToText"),
])
def test_a_decoder_loads_as_its_causal_lm_or_as_the_multimodal_model_around_it(config, expected):
    assert _model_class(config).__name__ == expected


def test_remote_code_naming_its_causal_lm_class_keeps_it_where_remote_code_is_trusted():
    config = transformers.LlavaConfig()
    config.auto_map = {"AutoConfig": "m.Config", "AutoModelForCausalLM": "m.ForCausalLM"}
    assert _model_class(config, trust_remote_code=True).__name__ == "AutoModelForCausalLM"
    assert _model_class(config).__name__ == "AutoModelForImageTextToText"  # untrusted: transformers' own class

    class Custom(transformers.PretrainedConfig):  # remote code's config class under a built-in type: its model decides
        model_type = "llava"

    assert _model_class(Custom()).__name__ == "AutoModelForImageTextToText"


@pytest.mark.parametrize("config, why", [
    (transformers.Blip2Config(), "needs pixel_values in every forward pass"),
    (transformers.Pix2StructConfig(), "is an encoder-decoder model"),
    (transformers.T5Config(), "no text-generation class for model type 't5'"),
])
def test_what_has_no_text_decoder_of_its_own_is_refused_naming_why(config, why):
    with pytest.raises(ModelLoadError, match=why):
        _model_class(config)


def test_a_gptq_checkpoint_whose_layer_names_transformers_does_not_have_is_refused_naming_both():
    """GPTQModel writes some architectures' layers under names transformers 5 has not (MoE experts one by one where
    transformers fuses them; Phi-3's split gate_up_proj): the refusal says so, not that the config is wrong."""
    loading = {"missing_keys": ["model.layers.0.mlp.experts.down_proj"],
               "unexpected_keys": ["model.layers.0.mlp.experts.0.down_proj.qweight", "model.layers.0.mlp.experts.0.down_proj.scales"]}
    message = unread_weights(loading, "gptq")
    assert "experts.0.down_proj.qweight" in message and "experts.down_proj" in message and "quantization_config" not in message
    assert "needs model.quantization: gptq" in unread_weights(loading, "none")  # read as a plain checkpoint: the config


@pytest.mark.parametrize("unexpected", [
    ["model.layers.0.mlp.down_proj.weight_scale_inv"],  # fp8 (DeepSeek's layout)
    ["model.layers.0.mlp.down_proj.SCB", "model.layers.0.mlp.down_proj.weight_format"],  # bitsandbytes int8
    ["model.layers.0.mlp.down_proj.weight.absmax", "model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__nf4"],
])
def test_every_weight_present_beside_quantization_tensors_it_did_not_read_is_refused(unexpected):
    """A quantized checkpoint whose config.json lost its quantization_config loads its codes as weights, none
    missing: transformers serves that noise."""
    assert "quantization tensors this load did not read" in unread_weights({"missing_keys": [], "unexpected_keys": unexpected})
    assert unread_weights({"missing_keys": [], "unexpected_keys": ["model.layers.0.self_attn.rotary_emb.inv_freq"]}) is None


def test_an_error_transformers_raises_loading_a_checkpoint_is_refused_naming_the_model(monkeypatch, tmp_path):
    """GPT-2's GPTQ checkpoints: transformers' own init reads a weight its GPTQ layer has not (an AttributeError)."""
    from app.config import ModelConfig
    from app.models import loader

    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                             vocab_size=64).save_pretrained(tmp_path)

    def broken(*args, **kwargs):
        raise AttributeError("'TorchAtenLinear' object has no attribute 'weight'")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    with pytest.raises(ModelLoadError, match="could not be loaded.*AttributeError.*has no attribute 'weight'"):
        loader.load_model(ModelConfig(source=str(tmp_path), dtype="float32"))


def test_a_quantization_refusal_names_the_model_once(tmp_path):
    from app.config import ModelConfig
    from app.models import loader

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      vocab_size=64)
    config.quantization_config = {"quant_method": "awq", "bits": 4}
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        loader.load_model(ModelConfig(source=str(tmp_path), dtype="float32"))
    assert str(refused.value).count(str(tmp_path)) == 1 and "pre-quantized with awq" in str(refused.value)
