"""What to load: the model's source, name, dtype, device and quantization (``model:`` of a served model)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATION_METHODS = ("none", "bnb-int8", "bnb-nf4", "gptq")  # app.models.quantization implements them
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")  # app/api/tools.py implements them (auto: the chat template's)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # app/api/reasoning.py: <think>...</think> apart from the answer
SERVED_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}$")



@dataclass
class ModelConfig:
    """Which model to load and how.

    ``source`` is a Hugging Face hub id, a local checkpoint directory, a ``.gguf`` file, or a
    built-in name (see ``app.models.registry``). ``name`` is the id clients put in ``"model"``.
    ``quantization``: ``none`` (``dtype`` as set), ``bnb-int8`` / ``bnb-nf4`` (bitsandbytes, applied
    while loading a full-precision checkpoint) or ``gptq`` (``source`` is a GPTQ checkpoint).
    """

    source: str = "smollm2-135m-instruct"
    name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    revision: str | None = None
    trust_remote_code: bool = False
    quantization: str = "none"
    # how tool_choice "auto" reads calls from its text: hermes, llama3_json, mistral, or auto (the format the chat
    # template teaches: app/api/tools.py tool_parser_for)
    tool_parser: str = "auto"
    # a reasoning model's <think>...</think> as the message's `reasoning`, apart from its content (app/api/reasoning.py);
    # None: the text as the model wrote it, as vLLM without --reasoning-parser
    reasoning_parser: str | None = None
    # auto: requests' unset sampling fields take the checkpoint's generation_config.json values, as vLLM does
    # (app/models/generation_defaults.py); none: OpenAI's defaults (vLLM's --generation-config vllm)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if not self.source or not isinstance(self.source, str):
            raise ValueError("model.source must name a Hugging Face model id, a directory, a .gguf file or a built-in model")
        self.name = self.name or _default_name(self.source)
        if not SERVED_NAME_PATTERN.match(self.name):
            raise ValueError(f"model.name {self.name!r} must be 1-128 characters of letters, digits and ._-/:")
        self.dtype = DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower())
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype {self.dtype!r} is not one of {', '.join(DTYPES)} (or bf16/fp16/fp32)")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"model.quantization {self.quantization!r} is not one of {', '.join(QUANTIZATION_METHODS)} "
                "(gptq needs a GPTQ checkpoint: make one with `python -m app quantize`)"
            )
        if self.tool_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(f"model.tool_parser {self.tool_parser!r} is not one of auto, {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"model.reasoning_parser {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)} "
                             "(or null: none)")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"model.generation_config {self.generation_config!r} is not auto or none")
        if self.device not in DEVICES:
            raise ValueError(f"model.device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"model.max_model_len must be an integer >= 2 or null, got {self.max_model_len!r}")


def _default_name(source: str) -> str:
    """A hub id names itself; a local directory or .gguf file is named by its last path part (a relative path that
    exists is one, as the loader reads it: ``ck/llama/`` is ``llama``)."""
    if source.startswith((".", "/", "~")) or source.endswith(".gguf") or Path(source).expanduser().exists():
        return Path(source).name.removesuffix(".gguf") or "model"
    return source
