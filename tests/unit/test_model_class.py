"""Which transformers class loads a checkpoint (app/models/loader.py ``_model_class``), from its config alone: a causal
LM, an image-text-to-text model whose text decoder runs alone, or a refusal naming why, before any weight is read."""

import pytest
import transformers

from app.models.loader import ModelLoadError, _model_class


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
