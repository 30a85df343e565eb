"""The benchmark's seeded model shapes: the advertised size is the size transformers builds."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.bench.shapes import SHAPES, parameter_count


def test_the_371m_shape_has_371m_parameters():
    with torch.device("meta"):  # shapes only: no memory, no time
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, **SHAPES["llama-371m"]))
    assert sum(p.numel() for p in model.parameters()) == parameter_count("llama-371m")
    assert round(parameter_count("llama-371m") / 1e6) == 371
