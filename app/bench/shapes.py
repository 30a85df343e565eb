"""Larger models for the benchmarks, built from a seed: ``python -m app.bench shape --shape llama-371m``.

Users serve models larger than the embedded 135M one, and the kernels' balance changes with the shapes (wider
products, more bytes per step). No weights can be downloaded here, so the bench builds a Llama-shaped checkpoint
of seeded random weights in bf16 with the embedded model's tokenizer: the same matrices a trained model of that
shape multiplies, so throughput is what that model would get (its text is noise; the workloads ignore EOS and run
to their token counts). Every server in a comparison loads the same directory.
"""

from __future__ import annotations

from pathlib import Path

SHAPES = {
    # 371M parameters: hidden 1024, 24 layers, 16 query / 4 KV heads, MLP 2816, an untied output head
    "llama-371m": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "intermediate_size": 2816, "tie_word_embeddings": False},
}


def build_shape(name: str, seed: int = 0, out: Path | None = None) -> Path:
    """The checkpoint directory of shape ``name`` and ``seed`` (built once into the cache, then reused)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from app.models.registry import cache_dir, prepare_builtin

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    out = out or cache_dir() / f"bench-{name}-seed{seed}"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(prepare_builtin("smollm2-135m-instruct"))
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SHAPES[name])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)  # whole or absent: a reader never sees half a checkpoint
    return out


def parameter_count(name: str) -> int:
    """Parameters of shape ``name`` (embedding and head included), from its config alone."""
    shape = SHAPES[name]
    hidden, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    vocab = 49152
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if shape["tie_word_embeddings"] else 2) + hidden
