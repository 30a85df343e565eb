"""Quantization settings that cannot work fail before any weights load, saying what to do."""

import builtins
from importlib import resources
import json
import os

import pytest
import torch

from app.models.gptq import GPTQSettings, GPTQSettingsError, check_group_size, load_calibration
from app.models.quantization import QuantizationError, check_bitsandbytes, from_pretrained_kwargs

CPU = torch.device("cpu")


def _checkpoint(tmp_path, quantization_config=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama"}
    if quantization_config:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_gptq_needs_a_checkpoint_with_a_quantization_config(tmp_path):
    with pytest.raises(QuantizationError, match="needs a GPTQ checkpoint.*python -m app quantize"):
        from_pretrained_kwargs("gptq", _checkpoint(tmp_path), torch.bfloat16, CPU, {})


def test_gptq_refuses_another_method_s_checkpoint(tmp_path):
    path = _checkpoint(tmp_path, {"quant_method": "awq"})
    with pytest.raises(QuantizationError, match="has a awq quantization_config"):
        from_pretrained_kwargs("gptq", path, torch.bfloat16, CPU, {})


def test_a_gptq_checkpoint_asks_for_quantization_gptq(tmp_path):
    path = _checkpoint(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(QuantizationError, match="set model.quantization: gptq"):
        from_pretrained_kwargs("none", path, torch.bfloat16, CPU, {})
    assert from_pretrained_kwargs("gptq", path, torch.bfloat16, CPU, {}) == {}


def test_bnb_refuses_an_already_quantized_checkpoint(tmp_path):
    path = _checkpoint(tmp_path, {"quant_method": "gptq"})
    with pytest.raises(QuantizationError, match="already quantized"):
        from_pretrained_kwargs("bnb-nf4", path, torch.bfloat16, CPU, {})


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "its lm_head is GPTQ-quantized"),  # transformers leaves it
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*mlp.*": {}}}, "per-module overrides"),  # optimum ignores them
])
def test_a_gptq_checkpoint_transformers_would_read_only_in_part_is_refused_saying_what(tmp_path, quantization_config, message):
    with pytest.raises(QuantizationError, match=message):
        from_pretrained_kwargs("gptq", _checkpoint(tmp_path, quantization_config), torch.bfloat16, CPU, {})


def test_a_quantization_configs_method_is_read_as_transformers_reads_it(tmp_path):
    with pytest.raises(QuantizationError, match="transformers does not read; write it \"gptq\""):  # its own error, deep
        from_pretrained_kwargs("gptq", _checkpoint(tmp_path / "a", {"quant_method": "GPTQ", "bits": 4}), torch.bfloat16, CPU, {})
    with pytest.raises(QuantizationError, match="pre-quantized with bitsandbytes"):  # an older config: no quant_method
        from_pretrained_kwargs("none", _checkpoint(tmp_path / "b", {"load_in_8bit": True}), torch.bfloat16, CPU, {})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({"model_type": "llama", "compression_config": {"format": "x"}}))
    with pytest.raises(QuantizationError, match="pre-quantized with compressed-tensors"):
        from_pretrained_kwargs("none", str(tmp_path / "c"), torch.bfloat16, CPU, {})


def test_bnb_configs_name_the_requested_format(tmp_path):
    path = _checkpoint(tmp_path)
    int8 = from_pretrained_kwargs("bnb-int8", path, torch.bfloat16, CPU, {})["quantization_config"]
    nf4 = from_pretrained_kwargs("bnb-nf4", path, torch.bfloat16, CPU, {})["quantization_config"]
    assert int8.load_in_8bit and not int8.load_in_4bit
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_compute_dtype == torch.bfloat16


def test_bnb_without_a_usable_library_says_how_to_get_one(monkeypatch):
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise OSError("libbitsandbytes_cpu.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(QuantizationError, match="bitsandbytes is not usable here.*pip install bitsandbytes"):
        check_bitsandbytes(CPU)


def test_bnb_on_a_device_it_has_no_backend_for():
    with pytest.raises(QuantizationError, match="no backend for mps"):
        check_bitsandbytes(torch.device("mps"))


@pytest.mark.parametrize(
    "fields, message",
    [({"bits": 5}, "bits must be one of"), ({"group_size": 0}, "group_size must be"), ({"damp_percent": 2}, "damp_percent")],
)
def test_bad_gptq_settings(fields, message):
    with pytest.raises(GPTQSettingsError, match=message):
        GPTQSettings(**fields)


def test_group_size_must_divide_every_layer(tmp_path):
    config = {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "num_hidden_layers": 1, "vocab_size": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GPTQSettingsError, match=r"group_size 128 does not divide .*576.*use group_size 64"):
        check_group_size(str(tmp_path), 128)
    check_group_size(str(tmp_path), 64)
    check_group_size(str(tmp_path), -1)


def test_calibration_files(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    text = tmp_path / "c.txt"
    text.write_text("first passage\nstill first\n\nsecond\n")
    assert load_calibration(jsonl) == ["one", "two"]
    assert load_calibration(text) == ["first passage\nstill first", "second"]
    shipped = resources.files("app.models").joinpath("data", "calibration.jsonl").read_text().splitlines()
    assert len(load_calibration()) == len(shipped) >= 32 and len(load_calibration(limit=5)) == 5
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(GPTQSettingsError, match="holds no texts"):
        load_calibration(tmp_path / "empty.txt")


def test_group_sizes_torch_cannot_run_are_never_advised(tmp_path):
    """torch's int4 matmul takes groups of 32, 64, 128 or 256: a model whose layers only 16 divides gets -1."""
    config = {"model_type": "llama", "hidden_size": 80, "intermediate_size": 160, "num_attention_heads": 5,
              "num_key_value_heads": 5, "num_hidden_layers": 1, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GPTQSettingsError, match=r"use group_size -1"):
        check_group_size(str(tmp_path), 64)


def test_a_quantization_that_fails_leaves_no_partial_checkpoint_and_a_lost_offload_says_what_to_do(tmp_path, monkeypatch):
    """GPTQModel's disk offload loses GPT-NeoX's output layer (embed_out, not lm_head) at save."""
    import sys
    import types

    from app.models.gptq import quantize_gptq

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 128}
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    seen = {}

    class Model:
        def quantize(self, texts, batch_size):
            pass

        def save(self, path):
            os.makedirs(path)
            raise FileNotFoundError("Offloaded tensor 'lm_head.weight' not found in offload directory '/tmp/gptqmodel_x'")

    def load(source, config, **kwargs):
        seen["offload"] = config.offload_to_disk
        return Model()

    fake = types.SimpleNamespace(GPTQModel=types.SimpleNamespace(load=load),
                                 QuantizeConfig=lambda **fields: types.SimpleNamespace(**fields))
    monkeypatch.setitem(sys.modules, "gptqmodel", fake)
    with pytest.raises(GPTQSettingsError, match="--no-offload"):
        quantize_gptq(str(source), tmp_path / "out", GPTQSettings(group_size=32), ["text"])
    assert seen["offload"] is True and sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    with pytest.raises(FileNotFoundError):  # without the offload, GPTQModel's own error
        quantize_gptq(str(source), tmp_path / "out", GPTQSettings(group_size=32, offload_to_disk=False), ["text"])
    assert seen["offload"] is False and sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_a_bnb_load_that_leaves_most_weights_at_full_precision_says_so(caplog):
    """transformers quantizes nn.Linear layers alone: a MoE's fused experts stay as they are, and the load says so."""
    import logging

    import bitsandbytes as bnb
    import transformers

    from app.models.quantization import left_in_full_precision, warn_about_unquantized

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                 vocab_size=64)
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=8, **small))
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    for model in (moe, dense):  # as transformers' bitsandbytes integration replaces them: nn.Linear layers alone
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear and child is not model.get_output_embeddings():
                    setattr(parent, name, bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False))
    assert "MixtralExperts" in left_in_full_precision(moe) and left_in_full_precision(dense) == {}
    with caplog.at_level(logging.WARNING, logger="app.models.quantization"):
        warn_about_unquantized("tiny-moe", "bnb-int8", moe)
        warn_about_unquantized("tiny-dense", "bnb-int8", dense)
    assert "tiny-moe" in caplog.text and "MixtralExperts" in caplog.text and "tiny-dense" not in caplog.text
