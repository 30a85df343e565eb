"""Load a causal LM and its tokenizer from any source a ModelConfig may name."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from app.config import ModelConfig
from app.engine import host_cpus
from app.engine.text_config import text_config
from app.models.attention_layers import require_attention_decoder
from app.models.exact_context import asked_past_stated_context, exact_context_limit, rope_scaled_context
from app.models.generation_defaults import checkpoint_sampling_defaults
from app.models.quantization import QuantizationError, from_pretrained_kwargs, warn_about_unquantized
from app.models.unread_weights import unread_weights
from app.quiet import quiet_gptqmodel
from app.models.registry import BUILTIN_MODELS, prepare_builtin

logger = logging.getLogger(__name__)

# bitsandbytes int8 computes in fp16 and says so on every call; once per process is plenty (it is in the docs).
warnings.filterwarnings("once", message="MatMul8bitLt: inputs will be cast")

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the model and what is wrong."""


@dataclass
class LoadedModel:
    """A model ready for the engine: weights on their device plus what the engine needs to know."""

    name: str
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype  # what activations (and the KV cache) are computed in
    max_model_len: int
    eos_token_ids: frozenset[int]
    weight_dtype: torch.dtype | None = None  # set when Linear weights are stored narrower than dtype (see below)
    bf16_products: bool = False  # Linear layers multiply in bf16 (activations rounded too) on our avx512_bf16 kernel
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # generation_config.json's (generation_defaults.py)

    @property
    def vocab_size(self) -> int:
        """The rows of the model's logits: its (text) config's vocabulary, else the tokenizer's."""
        return int(getattr(text_config(self.model.config), "vocab_size", None) or len(self.tokenizer))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but torch sees no CUDA GPU; use device: auto or cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: torch.dtype | None = None,
                  model_type: str | None = None) -> torch.dtype:
    if dtype != "auto":
        return _TORCH_DTYPES[dtype]
    if device.type == "cuda":
        # native bf16 only (Ampere on): torch's default also counts GPUs that emulate it (T4, V100), several times slower
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if model_type in FLOAT16_UNSTABLE:  # never float16 (vLLM's auto leaves it out for them too)
            return torch.bfloat16 if native_bf16 else torch.float32
        if checkpoint_dtype == torch.float16:  # as it was trained and stored: bf16 would drop 3 bits of it (vLLM keeps it too)
            return torch.float16
        return torch.bfloat16 if native_bf16 else torch.float16
    return auto_cpu_dtype()


# Architectures whose activations overflow float16 (vLLM refuses them in float16 for the same reason)
FLOAT16_UNSTABLE = ("gemma2", "gemma3", "gemma3_text", "glm4", "plamo2")


def _refuse_unstable_float16(checkpoint_config, dtype: torch.dtype, source: str) -> None:
    model_type = getattr(checkpoint_config, "model_type", None)
    if dtype == torch.float16 and model_type in FLOAT16_UNSTABLE:
        raise ModelLoadError(f"model {source!r}: {model_type} is numerically unstable in float16 (its activations overflow "
                             "it); set model.dtype: float32, or bfloat16 where the device has it")


def _checkpoint_config(path: str, common: dict):
    """The checkpoint's config, read before its weights (None where it cannot be read alone: the load says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, **common)
    except Exception:  # noqa: BLE001 - from_pretrained below reports it, naming the model
        return None


def _stored_dtype(checkpoint_config) -> torch.dtype | None:
    if checkpoint_config is None:
        return None
    value = getattr(text_config(checkpoint_config), "dtype", None) or getattr(checkpoint_config, "dtype", None)
    return value if isinstance(value, torch.dtype) else _TORCH_DTYPES.get(str(value).removeprefix("torch."))


def auto_cpu_dtype() -> torch.dtype:
    """fp32 where our CPU kernels run, else bf16 where the CPU computes it natively, else fp32 (for an unquantized
    model on a CPU with avx512_bf16, :func:`load_model` takes our bf16 kernel's path instead: ``_bf16_products``).

    The kernels compute in fp32 (a bf16-valued checkpoint's weights are still stored as bf16: half the
    bytes, the same bits) and beat torch's native bf16 where both run: on a 2-core AVX-512 EPYC with
    avx512_bf16, the engine alone served 32 streams at 370 tok/s in fp32 against 377 in bf16, and one
    stream at 65 tok/s against 29. Without our kernels, native bf16 halves the bytes each step reads.
    """
    from app.cpu.ops import available  # the engine's kernels; imported only when it matters

    if available():
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """AVX-512 bf16 or AMX: bf16 matmuls run natively and halve the bytes each decode step reads.

    Without them (e.g. AVX2-only CPUs) oneDNN emulates bf16: measured on an AVX2 EPYC, a 512x576x1536
    matmul ran at 1.3 GFLOP/s in bf16 against 168 in fp32, so batched steps were ~6x slower. oneDNN's own
    test (``_is_mkldnn_bf16_supported``) also passes on AVX-512 CPUs without avx512_bf16 (Skylake to Ice Lake)
    and on avx_ne_convert ones, where it converts rather than multiplies bf16: the CPU's flags decide first."""
    flags = host_cpus.cpu_flags()
    if flags is not None and not flags & {"avx512_bf16", "amx_bf16"}:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False



def resolve_source(source: str) -> tuple[str, str | None]:
    """Map a model source to (from_pretrained path or id, gguf file name or None)."""
    if source in BUILTIN_MODELS:
        try:
            return str(prepare_builtin(source)), None
        except (FileNotFoundError, OSError) as exc:
            raise ModelLoadError(f"model {source!r}: {exc}") from exc
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"model {source!r}: GGUF file not found")
        return str(path.parent), path.name
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model {source!r}: directory has no config.json, so it is not a Hugging Face checkpoint")
        return str(path), None
    if source.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {source!r}: no such file or directory")
    return source, None  # a hub id; from_pretrained reports if it cannot be fetched


def _hide_the_weight_loading_bar() -> None:
    """transformers draws a "Loading weights" progress bar at every start, done within a second; a quiet start
    shows our own log lines only. Download bars (a hub model fetched the first time) stay."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        if kwargs.get("desc") == "Loading weights":
            kwargs = {**kwargs, "disable": True}
        return factory(*args, **kwargs)

    hf_logging.set_tqdm_hook(hook)


def _model_class(checkpoint_config, trust_remote_code: bool = False):
    """transformers' class for the checkpoint: its causal LM, or, for a multimodal model type transformers registers
    as image-text-to-text alone (Mistral Small 3.1's mistral3, Qwen2.5-VL, LLaVA), that model, whose text decoder
    the engine serves (the load-time parity check decides whether it serves it exactly)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    model_type = getattr(checkpoint_config, "model_type", None)
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(checkpoint_config, "auto_map", None) or {})
    if model_type is None or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or remote:  # remote: its own class
        return AutoModelForCausalLM
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        _require_a_text_decoder(checkpoint_config, AutoModelForImageTextToText)
        return AutoModelForImageTextToText
    raise ModelLoadError(f"transformers has no text-generation class for model type {model_type!r} (neither a causal "
                         "LM nor an image-text-to-text model): not a model this server generates with")


def _require_a_text_decoder(checkpoint_config, auto_class) -> None:
    """An image-text-to-text model whose text decoder runs alone: not an encoder-decoder, nor one whose forward needs
    an image (BLIP-2's pixel_values) or other input beyond the text's."""
    import inspect

    model_type = checkpoint_config.model_type
    if getattr(checkpoint_config, "is_encoder_decoder", False):
        raise ModelLoadError(f"model type {model_type!r} is an encoder-decoder model: this server serves decoders")
    try:
        model_class = auto_class._model_mapping[type(checkpoint_config)]
    except (KeyError, ImportError):  # a config class of remote code: its model's to say
        return
    forward = inspect.signature(model_class.forward)
    needed = [name for name, parameter in forward.parameters.items() if name not in ("self", "input_ids")
              and parameter.default is inspect.Parameter.empty and parameter.kind is not parameter.VAR_KEYWORD
              and parameter.kind is not parameter.VAR_POSITIONAL]
    if needed:
        raise ModelLoadError(f"model type {model_type!r} needs {', '.join(needed)} in every forward pass: its text "
                             "decoder cannot be served alone")


def load_model(config: ModelConfig) -> LoadedModel:
    """Load weights and tokenizer; errors name the model and the cause."""
    from transformers import AutoTokenizer

    device = resolve_device(config.device)
    path, gguf_file = resolve_source(config.source)
    common = {"revision": config.revision, "trust_remote_code": config.trust_remote_code}
    if gguf_file:
        common["gguf_file"] = gguf_file
    checkpoint_config = _checkpoint_config(path, common)
    if checkpoint_config is not None:  # a state-space or recurrent model: said before any weight (None: the load says why)
        require_attention_decoder(text_config(checkpoint_config))
    dtype = resolve_dtype(config.dtype, device, _stored_dtype(checkpoint_config), getattr(checkpoint_config, "model_type", None))
    # auto asks for bf16 products too: the fastest path where the CPU multiplies bf16 natively and our kernel runs
    bf16_products = _bf16_products(config, device, torch.bfloat16 if config.dtype == "auto" else dtype)
    weight_dtype = None
    if bf16_products or _bf16_weights_on_fp32(config, device, dtype):
        dtype, weight_dtype = torch.float32, torch.bfloat16
    _refuse_unstable_float16(checkpoint_config, dtype, config.source)
    _hide_the_weight_loading_bar()
    if config.quantization == "gptq":
        quiet_gptqmodel()
    model_class = _model_class(checkpoint_config, config.trust_remote_code)
    try:
        quantization = _quantization_kwargs(config, path, gguf_file, dtype, device, common)
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
        # device_map, not .to(): quantized weights are placed as they load and must not move afterwards.
        model, loading = model_class.from_pretrained(
            path, dtype=dtype, device_map={"": device}, output_loading_info=True, **quantization, **common)
    except ModelLoadError:
        raise  # ours, naming the model already
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, SafetensorError) as exc:
        raise ModelLoadError(f"model {config.source!r} could not be loaded from {path!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - transformers' own code on this checkpoint (GPT-2's GPTQ layers): named
        raise ModelLoadError(f"model {config.source!r} (quantization {config.quantization}) could not be loaded from "
                             f"{path!r}: {type(exc).__name__}: {exc}") from exc
    problem = unread_weights(loading, config.quantization)
    if problem:
        raise ModelLoadError(f"model {config.source!r}: {problem}")
    _warn_about(config, model, tokenizer, device, dtype)
    model.eval()
    loaded = LoadedModel(
        name=config.name,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_model_len=_context_length(config, model, config.source),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        weight_dtype=weight_dtype,
        bf16_products=bf16_products,
        sampling_defaults=checkpoint_sampling_defaults(model, config.source) if config.generation_config == "auto" else {},
    )
    logger.info(
        "Loaded %s from %s on %s as %s%s, quantization %s (context %d)",
        config.name, path, device, dtype,
        " with bf16 Linear products" if bf16_products else " with bf16 Linear weights" if weight_dtype else "",
        config.quantization, loaded.max_model_len,
    )
    return loaded


def _warn_about(config: ModelConfig, model, tokenizer, device: torch.device, dtype: torch.dtype) -> None:
    """What loads and runs, but not as a user would expect it to."""
    vocab = getattr(text_config(model.config), "vocab_size", None) or model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:  # prompts holding the extra tokens are refused, each alone (a 400)
        logger.warning("model %s: its tokenizer has %d tokens, its embeddings %d (added tokens, weights not resized): "
                       "prompts holding the others are refused", config.source, len(tokenizer), vocab)
    outside = sorted(eos for eos in _eos_token_ids(model, tokenizer) if eos >= vocab)
    if outside:  # never sampled: an answer ends only at max_tokens or a stop
        logger.warning("model %s: its end-of-sequence token(s) %s lie past its %d embeddings, so no answer ends by "
                       "itself (only at max_tokens or a stop)", config.source, outside, vocab)
    if device.type == "cpu" and dtype == torch.float16:
        logger.warning("model %s: float16 on a CPU runs emulated, several times slower than float32 "
                       "(dtype: auto or float32 there)", config.source)
    if config.quantization.startswith("bnb"):
        warn_about_unquantized(config.source, config.quantization, model)


def auto_takes_bf16_products(device: torch.device) -> bool:
    """Whether ``dtype: auto`` (unquantized) loads onto our bf16-product kernel on ``device``."""
    return _bf16_products(ModelConfig(), device, torch.bfloat16)


def _bf16_products(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU with avx512_bf16 where our kernels run: Linear layers on our bf16 kernel, the rest in fp32.

    The kernel rounds activations and weights to bf16 and multiplies pairs with ``vdpbf16ps``, summing in fp32
    in a fixed order (a request's bits do not depend on its batch), while norms, attention, residuals and the
    KV cache stay fp32: at least as exact as a bf16 model, and faster than both torch's bf16 and our fp32 path
    (docs/performance.md). So ``dtype: auto`` takes it too for an unquantized model.
    """
    if device.type != "cpu" or dtype != torch.bfloat16 or config.quantization != "none":
        return False
    from app.cpu.linear_kernels import bf16_products_available  # the engine's kernels; imported only when it matters

    return bf16_products_available()


def _bf16_weights_on_fp32(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 asked for on a CPU without native bf16: bf16 Linear weights, fp32 activations, if our kernel builds.

    torch would emulate every bf16 matmul there (~6x slower batched, see cpu_has_native_bf16). Our
    AVX2 GEMM instead widens bf16 weights to fp32 in registers: the weights keep bf16's memory and
    bandwidth (a decode step of one sequence reads half the bytes) while activations, norms and the
    KV cache stay fp32, which is at least as exact as a bf16 model. The engine packs the weights
    (``app/cpu/linear_kernels.py``); quantized models keep the requested dtype.
    """
    if device.type != "cpu" or dtype != torch.bfloat16 or config.quantization != "none" or cpu_has_native_bf16():
        return False
    from app.cpu.ops import available  # the engine's kernels; imported only when it matters

    return available()


def _quantization_kwargs(config: ModelConfig, path: str, gguf_file: str | None, dtype, device, common: dict) -> dict:
    if gguf_file:
        if config.quantization != "none":
            raise ModelLoadError(f"model {config.source!r}: quantization applies to HF checkpoints, not .gguf files")
        return {}
    try:
        return from_pretrained_kwargs(config.quantization, path, dtype, device, common)
    except QuantizationError as exc:
        raise ModelLoadError(f"model {config.source!r}: {exc}") from exc


# Where configs state their context (GPT-2: n_positions, ChatGLM: seq_length, MPT: max_seq_len): the least one
# stated, as vLLM reads them
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                 "max_sequence_length", "max_seq_length", "seq_len")


def _context_length(config: ModelConfig, model: torch.nn.Module, source: str) -> int:
    model_config = text_config(model.config)  # a multimodal checkpoint's decoder
    stated = [int(value) for key in _CONTEXT_KEYS if isinstance(value := getattr(model_config, key, None), int) and value > 0]
    native = min(stated) if stated else None
    native, how = rope_scaled_context(model_config, native) or (native, "")  # app/models/exact_context.py
    exact, why = exact_context_limit(model_config) or (None, "")
    if config.max_model_len is None:
        if native is None:
            raise ModelLoadError(f"model {source!r} does not state its context length; set model.max_model_len")
        if exact is not None and native > exact:
            logger.warning("model %s: context capped at %d of its %d tokens: %s", source, exact, native, why)
            return exact
        return int(native)
    if native is not None and config.max_model_len > native:
        ceiling, how = asked_past_stated_context(model_config, native) or (None, how)
        if ceiling is None or config.max_model_len > ceiling:
            raise ModelLoadError(
                f"model {source!r}: max_model_len {config.max_model_len} exceeds the model's context of {native} tokens"
                + (f" ({how})" if how else "")
            )
    if exact is not None and config.max_model_len > exact:
        raise ModelLoadError(f"model {source!r}: max_model_len {config.max_model_len} is past the {exact} tokens this model "
                             f"is served exactly to: {why}; set model.max_model_len to at most {exact}")
    return config.max_model_len


def _eos_token_ids(model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
