"""What a checkpoint's files say beside its weights, read as a user's checkpoint states them: the sampling defaults
of generation_config.json, the context under the keys architectures use, an end-of-sequence token the embeddings
lack, and damaged files refused naming the model."""

from __future__ import annotations

import logging
import shutil

import pytest

from app.config import ModelConfig
from app.models import ModelLoadError, load_model
from tests.model.zoo.checkpoints import build_checkpoint

pytestmark = pytest.mark.model


def _copy(zoo_dir, tokenizer, tmp_path, name: str):
    path = tmp_path / name
    shutil.copytree(build_checkpoint("llama", zoo_dir, tokenizer), path)
    return path


def test_the_checkpoints_generation_config_gives_the_sampling_defaults(zoo_dir, tokenizer, tmp_path, caplog):
    """As vLLM applies generation_config.json: its sampling fields fill what a request leaves unset; a value no
    request may take is left out, and what transformers' generate applies beyond sampling is named at load."""
    from transformers import GenerationConfig

    path = _copy(zoo_dir, tokenizer, tmp_path, "llama-with-defaults")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, min_p=7.0,
                     max_new_tokens=64, suppress_tokens=[5], no_repeat_ngram_size=3).save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="app.models"):
        loaded = load_model(ModelConfig(source=str(path), dtype="float32"))
    assert loaded.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
                                        "max_tokens": 64}  # transformers' max_new_tokens, as vLLM reads it
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "min_p=7.0" in warned and "sets suppress_tokens, no_repeat_ngram_size" in warned
    assert load_model(ModelConfig(source=str(path), dtype="float32", generation_config="none")).sampling_defaults == {}


def test_a_damaged_weights_file_is_refused_naming_the_model(zoo_dir, tokenizer, tmp_path):
    path = _copy(zoo_dir, tokenizer, tmp_path, "llama-truncated")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="could not be loaded from"):
        load_model(ModelConfig(source=str(path), dtype="float32"))


def test_the_context_is_the_least_any_of_its_keys_states(zoo_dir, tokenizer, tmp_path):
    """ChatGLM states it as seq_length, MPT as max_seq_len: the least stated one, as vLLM reads them (512 stated as
    max_position_embeddings here)."""
    import json

    path = _copy(zoo_dir, tokenizer, tmp_path, "llama-seq-length")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "seq_length": 96}))
    assert load_model(ModelConfig(source=str(path), dtype="float32")).max_model_len == 96


def test_an_end_of_sequence_token_past_the_embeddings_is_named_at_load(zoo_dir, tokenizer, tmp_path, caplog):
    from transformers import GenerationConfig

    path = _copy(zoo_dir, tokenizer, tmp_path, "llama-eos-outside")
    GenerationConfig(eos_token_id=len(tokenizer) + 3).save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="app.models"):
        load_model(ModelConfig(source=str(path), dtype="float32"))
    assert f"end-of-sequence token(s) [{len(tokenizer) + 3}] lie past its {len(tokenizer)} embeddings" in caplog.text
