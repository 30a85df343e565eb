"""Tiny seeded random checkpoints of many transformers architectures, built once per test session.

Each is ``AutoModelForCausalLM.from_config`` of a small config (2-3 layers, hidden 64) with the embedded
model's tokenizer, saved as a plain HF checkpoint: what a user's model directory looks like, at a size the
suite can run in seconds. Sliding-window architectures get windows shorter than the test prompts, and Gemma 2
a softcap small enough to matter for random weights.
"""

from __future__ import annotations

import pathlib

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
WINDOW = 24  # sliding windows, shorter than the longest test prompts (and not a multiple of the block size)


def _gpt2():
    return dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)


def _no_gqa(**extra):
    return {**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, **extra}


# name -> (config class name, fields). The names are the test ids.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen2-sliding": ("Qwen2Config", {**SMALL, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}),
    "qwen3": ("Qwen3Config", {**SMALL, "head_dim": 16}),
    "mistral": ("MistralConfig", {**SMALL, "sliding_window": WINDOW}),
    "mixtral": ("MixtralConfig", {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "phi3": ("Phi3Config", {**SMALL, "pad_token_id": 0}),
    "phi": ("PhiConfig", _no_gqa(partial_rotary_factor=0.5)),
    "gpt2": ("GPT2Config", _gpt2()),
    "gpt-neox": ("GPTNeoXConfig", _no_gqa(rotary_pct=0.25)),
    "olmo2": ("Olmo2Config", SMALL),
    "granite": ("GraniteConfig", {**SMALL, "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                              max_position_embeddings=512)),
    "stablelm": ("StableLmConfig", {**SMALL, "partial_rotary_factor": 0.25}),
    "cohere": ("CohereConfig", {**SMALL, "logit_scale": 0.5}),
    "jetmoe": ("JetMoeConfig", dict(hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                                    intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=512)),  # repeats its keys to the query heads: refused
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                                    multi_query=True, parallel_attn=True, bias=False, alibi=False)),
    "gemma": ("GemmaConfig", {**SMALL, "head_dim": 16}),
    # larger weights, unscaled scores, capped at 0.5: the scores of small random weights are too small to be capped
    "gemma2": ("Gemma2Config", {**SMALL, "head_dim": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 0.5,
                                "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 1, "initializer_range": 0.1}),
    "gemma3": ("Gemma3TextConfig", {**SMALL, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2,
                                    "query_pre_attn_scalar": 16}),
    "starcoder2": ("Starcoder2Config", {**SMALL, "sliding_window": None}),
    # its router reads its own weight's dtype in its forward (a packed Linear keeps a stand-in of it)
    "hunyuan-moe": ("HunYuanMoEV1Config", {**SMALL, "head_dim": 16, "num_experts": 4, "moe_topk": 2}),
    # its config's window is past any context served here: every layer attends the whole history (refused before)
    "phimoe": ("PhimoeConfig", {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096}),
    # sliding layers in its config that never pass their window to the attention function: refused by the check
    "qwen2-moe-mixed": ("Qwen2MoeConfig", {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                           "shared_expert_intermediate_size": 64, "use_sliding_window": True,
                                           "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    # YaRN over 16 positions, factor 16: served to 256 (app/models/exact_context.py), every test prompt past the 16
    "qwen2-yarn": ("Qwen2Config", {**SMALL, "max_position_embeddings": 16,
                                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                                       "original_max_position_embeddings": 16}}),
    # linear over 16 stated positions, factor 16: served to 16 unless asked for up to 256 (the zoo asks for 256)
    "llama-linear": ("LlamaConfig", {**SMALL, "max_position_embeddings": 16,
                                     "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 16.0}}),
    # long factors from position 32 on: served to 32 tokens (app/models/exact_context.py)
    "phi3-longrope": ("Phi3Config", {**SMALL, "pad_token_id": 0, "original_max_position_embeddings": 32,
                                     "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 64.0]}}),
}


def build_checkpoint(name: str, directory: pathlib.Path, tokenizer) -> pathlib.Path:
    """Save a seeded random ``name`` model with ``tokenizer`` under ``directory / name`` (once)."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = directory / name
    if (path / "config.json").exists():
        return path
    class_name, fields = ARCHITECTURES[name]
    config = getattr(transformers, class_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_norms(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _spread_norms(model: torch.nn.Module) -> None:
    """Random (not all-one) norm weights and biases: a norm applied the wrong way must show in the logits."""
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "norm" in name or "ln" in name.split(".")[-2:][0]:
            parameter.add_(torch.rand(parameter.shape, generator=generator) * 0.2 - 0.1)
