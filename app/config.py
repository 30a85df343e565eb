"""Dataclass configs for the app, validated at construction and read from YAML.

Every config raises ``ValueError`` with a message a user can act on. ``AppConfig.from_args`` is
what ``deployments/builder.py`` calls with the application ``args`` of ``serve_config.yaml``:
an optional ``config:`` YAML file, deep-merged with whatever else the args say.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DEVICES = ("auto", "cpu", "cuda")
BATCHING_MODES = ("none", "dynamic", "continuous")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")  # auto: the dtype the model computes in (bf16 products: bfloat16)
# The CPU fast path (app/cpu/): each part can be turned back to torch's ops.
CPU_LINEAR_KERNELS = ("auto", "avx2", "avx512-bf16", "onednn", "onednn-bf16", "torch")  # app/cpu/linear.py
CPU_ATTENTION_KERNELS = ("auto", "torch")  # app/cpu/attention.py
CPU_NORM_KERNELS = ("auto", "torch")  # app/cpu/norm.py
CPU_ROTARY_KERNELS = ("auto", "torch")  # app/cpu/rotary.py
CPU_DECODER_LAYERS = ("auto", "torch")  # app/cpu/decoder.py
CPU_GPTQ_KERNELS = ("auto", "torch")  # app/cpu/gptq.py
_CPU_CHOICES = {
    "cpu_linear_kernel": CPU_LINEAR_KERNELS, "cpu_attention_kernel": CPU_ATTENTION_KERNELS, "cpu_norm_kernel": CPU_NORM_KERNELS,
    "cpu_rotary_kernel": CPU_ROTARY_KERNELS, "cpu_decoder_layer": CPU_DECODER_LAYERS, "cpu_gptq_kernel": CPU_GPTQ_KERNELS,
}
QUANTIZATION_METHODS = ("none", "bnb-int8", "bnb-nf4", "gptq")  # app.models.quantization implements them
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
        if self.device not in DEVICES:
            raise ValueError(f"model.device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"model.max_model_len must be an integer >= 2 or null, got {self.max_model_len!r}")


def _default_name(source: str) -> str:
    """A hub id names itself; a local directory or .gguf file is named by its last path part."""
    if source.startswith((".", "/", "~")) or source.endswith(".gguf"):
        return Path(source).name.removesuffix(".gguf") or "model"
    return source


SPEC_DRAFTERS = ("none", "ngram", "model")


@dataclass
class SpecConfig:
    """Speculative decoding: drafts proposed for each decoding sequence and verified by the next step (app/spec/).

    ``ngram`` drafts by prompt lookup (no model); ``model`` asks another model of the app (``draft``: its
    name) for drafts, which it computes on its own replicas while this engine verifies (app/spec/remote.py).
    Drafts are verified losslessly (rejection sampling on the request's own processed distribution); a
    greedy request's output is exactly what it is without them.
    """

    drafter: str = "none"  # none | ngram | model
    num_speculative_tokens: int = 4  # the most drafts per sequence and step
    ngram_min: int = 1  # ngram: the shortest suffix to look up
    ngram_max: int = 3  # ngram: the longest suffix to look up (longer matches win)
    draft: str | None = None  # model: the name of the app's model that drafts (any causal LM with this tokenizer)
    # model: how long a sequence waits for drafts still being computed before it decodes a token without them
    max_draft_wait_ms: float = 500.0
    # model: draft window i+1 while the target verifies window i (assuming it keeps all of window i). Pays where
    # draft and target run on separate hardware; on a few shared CPU cores the two compete for the same cores.
    draft_ahead: bool = True
    # Batched tokens at which a target step costs twice a one-token step: how fast verifying extra tokens
    # stops being free as the batch grows (2-core AVX-512 EPYC: 1 token 15 ms, 32 sequences 85 ms: ~7).
    saturation_tokens: float = 8.0
    # Size each sequence's drafts by what pays (its acceptance, the batch, the measured costs; 0 where nothing
    # does), or false: always draft num_speculative_tokens, as vLLM does (for a pairing whose costs are known).
    adaptive: bool = True
    # Also serve the model under this name, and draft only for requests addressed to it (unset: for every
    # eligible request): one engine, with and without speculation side by side, as in the default app.
    served_name: str | None = None

    def __post_init__(self) -> None:
        if self.drafter not in SPEC_DRAFTERS:
            raise ValueError(f"engine.speculative.drafter {self.drafter!r} is not one of {', '.join(SPEC_DRAFTERS)}")
        _require_int("engine.speculative.num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        _require_int("engine.speculative.ngram_min", self.ngram_min, minimum=1)
        _require_int("engine.speculative.ngram_max", self.ngram_max, minimum=self.ngram_min)
        if not isinstance(self.saturation_tokens, (int, float)) or self.saturation_tokens <= 0:
            raise ValueError("engine.speculative.saturation_tokens must be a number > 0")
        if not isinstance(self.max_draft_wait_ms, (int, float)) or self.max_draft_wait_ms < 0:
            raise ValueError("engine.speculative.max_draft_wait_ms must be a number >= 0")
        if not isinstance(self.adaptive, bool):
            raise ValueError("engine.speculative.adaptive must be true or false")
        if self.served_name is not None and (not isinstance(self.served_name, str) or not self.served_name):
            raise ValueError("engine.speculative.served_name must be a non-empty string (or unset)")
        if self.served_name is not None and not self.enabled:
            raise ValueError("engine.speculative.served_name needs a drafter (drafter: ngram or model)")
        if (self.drafter == "model") != (self.draft is not None):
            raise ValueError("engine.speculative: drafter: model needs draft: <the name of the app's model that drafts>, "
                             "and draft is only for drafter: model")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"


def _drafters(speculative: "SpecConfig | list[SpecConfig]") -> list[SpecConfig]:
    """The enabled drafters of ``engine.speculative`` (one mapping, or a list of them with distinct served names)."""
    specs = speculative if isinstance(speculative, list) else [speculative]
    enabled = [spec for spec in specs if spec.enabled]
    if len(enabled) > 1 and any(spec.served_name is None for spec in enabled):
        raise ValueError("engine.speculative: with several drafters, each needs its own served_name")
    return enabled


@dataclass
class EngineConfig:
    """How the engine batches and schedules work on a replica.

    ``batching``: ``none`` runs one request at a time; ``dynamic`` runs each group formed by the
    ``@serve.batch`` window (``max_batch_size``, ``batch_wait_timeout_s``) to completion before the
    next starts; ``continuous`` (default) merges new requests into the running batch at every step.
    """

    batching: str = "continuous"
    max_batch_size: int = 32  # @serve.batch window: requests admitted together
    batch_wait_timeout_s: float = 0.01  # how long the window waits for batch-mates (never for a lone request)
    max_num_seqs: int = 64  # sequences in one step's batch
    max_num_batched_tokens: int = 2048  # tokens in one step (decodes first, then chunks of prefills; vLLM CPU's default)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_mb: int = 0  # 0: auto (CUDA: 80% of free memory after loading; CPU: min(1 GiB, 20% of RAM))
    num_kv_blocks: int = 0  # >0 overrides kv_cache_memory_mb (tests use it to force preemption)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model's: bf16 where dtype resolves to bf16) | bfloat16 | float32
    stream_interval_ms: int = 0  # under load (>1 running), send a request's tokens at most this often (0: each at once)
    max_stream_chunks_per_s: float = 0  # under load, all streams together send at most this many chunks/s (0: no cap)
    separate_process: bool = True  # run the core in its own process (no GIL shared with the server's threads)
    torch_threads: int = 0  # 0: one thread per core the process may use
    cpu_linear_kernel: str = "auto"  # fp32 on CPU: auto | avx2 (ours) | onednn | onednn-bf16 | torch (docs/engine.md)
    cpu_attention_kernel: str = "auto"  # fp32 on CPU, every step: auto (ours where it builds) | torch (gather + SDPA)
    cpu_norm_kernel: str = "auto"  # fp32 RMSNorm on CPU: auto (ours where it builds and matches the model's) | torch
    cpu_rotary_kernel: str = "auto"  # fp32 RoPE in one-frame decoder layers: auto (ours where it gives the model's bits) | torch
    cpu_decoder_layer: str = "auto"  # packed CPU layers: auto (one-frame forward where it gives the module's bits) | torch
    cpu_gptq_kernel: str = "auto"  # GPTQ 4-bit layers on CPU: auto (ours where the CPU has avx512_bf16) | torch (GPTQModel's)
    # Requests a replica holds waiting for a place in the running batch (beyond max_num_seqs running); one more
    # gets 503 with Retry-After instead of waiting behind an ever longer queue (docs/configuration.md: Backpressure).
    max_queued_requests: int = 64
    max_queue_time_s: float = 0  # > 0: a request without its first token after this long ends with 503 (0: no deadline)
    # no step completed for this long while requests wait: the engine is wedged, the replica's health check fails
    step_timeout_s: float = 60.0
    # drafts verified in the next step (none by default): one drafter, or a list of them, each under its served_name
    speculative: SpecConfig | list[SpecConfig] = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"engine.batching {self.batching!r} is not one of {', '.join(BATCHING_MODES)}")
        for name in ("max_batch_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests"):
            _require_int(f"engine.{name}", getattr(self, name), minimum=1)
        for name in ("kv_cache_memory_mb", "num_kv_blocks", "torch_threads", "stream_interval_ms"):
            _require_int(f"engine.{name}", getattr(self, name), minimum=0)
        if not isinstance(self.max_stream_chunks_per_s, (int, float)) or self.max_stream_chunks_per_s < 0:
            raise ValueError(f"engine.max_stream_chunks_per_s must be a number >= 0, got {self.max_stream_chunks_per_s!r}")
        if isinstance(self.step_timeout_s, bool) or not isinstance(self.step_timeout_s, (int, float)) or self.step_timeout_s <= 0:
            raise ValueError(f"engine.step_timeout_s must be a number of seconds > 0, got {self.step_timeout_s!r}")
        if not isinstance(self.batch_wait_timeout_s, (int, float)) or self.batch_wait_timeout_s < 0:
            raise ValueError(f"engine.batch_wait_timeout_s must be a number >= 0, got {self.batch_wait_timeout_s!r}")
        if not isinstance(self.max_queue_time_s, (int, float)) or isinstance(self.max_queue_time_s, bool) or self.max_queue_time_s < 0:
            raise ValueError(f"engine.max_queue_time_s must be a number >= 0 (0: no deadline), got {self.max_queue_time_s!r}")
        self.kv_cache_dtype = DTYPE_ALIASES.get(str(self.kv_cache_dtype).lower(), str(self.kv_cache_dtype).lower())
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"engine.kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        for name, choices in _CPU_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"engine.{name} {getattr(self, name)!r} is not one of {', '.join(choices)}")
        self.drafters = _drafters(self.speculative)
        if self.batching == "none":
            self.max_num_seqs = 1  # the naive baseline: one request at a time, whatever else is set


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class ReplicaConfig:
    """Ray Serve options of a model's replica deployment (serve_config.yaml may override them too)."""

    num_replicas: int | str = 1  # an integer, or "auto" to autoscale
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None: 1 when the model's device resolves to cuda, else 0
    # What Serve hands one replica at a time. None: room for the engine's running batch, its queue and one
    # admission window (max_num_seqs + engine.max_queued_requests + max_batch_size), so that past its bound
    # the engine answers (503, Retry-After) rather than requests waiting in Serve's queue.
    max_ongoing_requests: int | None = None
    # Serve's queue at each caller (proxy, handles) for when no replica can take a request (all full, starting
    # or being replaced); past it Serve answers 503 with Retry-After itself. -1: unbounded.
    max_queued_requests: int = 64
    autoscaling_config: dict[str, Any] | None = None
    # num_replicas auto: the engine's waiting + running sequences per replica the autoscaler aims at
    # (deployments/autoscaling.py); Serve's ongoing requests against target_ongoing_requests where unreported.
    target_queue_depth: float = 16
    # Serve's max_replicas_per_node: at most this many replicas of the deployment on one Ray node (1: one per
    # node, so the replicas spread over the cluster). None: no limit.
    max_replicas_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.num_replicas != "auto" and (not isinstance(self.num_replicas, int) or self.num_replicas < 1):
            raise ValueError(f"replica.num_replicas must be an integer >= 1 or 'auto', got {self.num_replicas!r}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ValueError("replica.num_cpus and replica.num_gpus must not be negative")
        if self.max_ongoing_requests is not None:
            _require_int("replica.max_ongoing_requests", self.max_ongoing_requests, minimum=1)
        if self.max_queued_requests != -1:
            _require_int("replica.max_queued_requests (or -1: unbounded)", self.max_queued_requests, minimum=1)
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, dict):
            raise ValueError("replica.autoscaling_config must be a mapping of Serve's autoscaling options (or null)")
        if (not isinstance(self.target_queue_depth, (int, float)) or isinstance(self.target_queue_depth, bool)
                or self.target_queue_depth <= 0):
            raise ValueError(f"replica.target_queue_depth must be a number > 0, got {self.target_queue_depth!r}")
        if self.max_replicas_per_node is not None:
            _require_int("replica.max_replicas_per_node (or null)", self.max_replicas_per_node, minimum=1)


SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class ServedModelConfig:
    """One model served by the app: what to load, how to run it, how to deploy it.

    ``default_sampling`` fills the sampling fields a request leaves unset (like vLLM's
    generation-config defaults): small models answer better at a low temperature than at
    OpenAI's default of 1.0.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    default_sampling: dict[str, float] = field(default_factory=dict)

    @property
    def served_names(self) -> list[str]:
        """The names clients may send as "model": the model's, then those of its speculative twins."""
        return [self.model.name] + [spec.served_name for spec in self.engine.drafters if spec.served_name]

    def __post_init__(self) -> None:
        unknown = sorted(set(self.default_sampling) - set(SAMPLING_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"default_sampling: unknown key(s) {', '.join(unknown)} (known: {', '.join(SAMPLING_DEFAULT_KEYS)})")
        if self.replica.max_ongoing_requests is None:
            engine = self.engine
            self.replica.max_ongoing_requests = engine.max_num_seqs + engine.max_queued_requests + engine.max_batch_size
        # Each request is one ongoing request at the replica while it streams; a smaller cap than the
        # batch window would make Serve hold back requests the batcher is waiting for.
        if self.engine.batching != "none" and self.replica.max_ongoing_requests < self.engine.max_batch_size:
            raise ValueError(
                f"replica.max_ongoing_requests ({self.replica.max_ongoing_requests}) must be at least "
                f"engine.max_batch_size ({self.engine.max_batch_size}), or Serve silently caps every batch; "
                "raise max_ongoing_requests (or leave it unset: batch, queue and one window) or lower max_batch_size"
            )


@dataclass
class AppConfig:
    """The whole application: the models it serves and the HTTP edge's limits."""

    models: list[ServedModelConfig] = field(default_factory=lambda: [ServedModelConfig()])
    max_request_bytes: int = 4 * 1024 * 1024  # larger bodies get 413
    # The ingress replicas host the first model themselves (its tokens stream with no Ray hop; it scales as the
    # ingress); false: the ingress only routes, every model is a deployment of its own (deployments/builder.py).
    ingress_hosts_first_model: bool = True

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the app must serve at least one model (models: [...])")
        names = [name for m in self.models for name in m.served_names]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be an integer >= 1024")
        if not isinstance(self.ingress_hosts_first_model, bool):
            raise ValueError("ingress_hosts_first_model must be true or false")
        own = {m.model.name for m in self.models}
        for served in self.models:
            for spec in served.engine.drafters:
                if spec.drafter == "model" and (spec.draft not in own or spec.draft == served.model.name):
                    raise ValueError(f"engine.speculative.draft of {served.model.name} must name another model of "
                                     f"this app (one of: {', '.join(sorted(own - {served.model.name})) or 'none'})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AppConfig":
        return _build(cls, data, "app")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "AppConfig":
        return cls.from_dict(_read_yaml(path))

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppConfig":
        """Build from serve_config.yaml ``args``: ``config: file.yaml`` first, the other args on top."""
        args = dict(args or {})
        base = _read_yaml(args.pop("config")) if "config" in args else {}
        return cls.from_dict(_deep_merge(base, args))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        # serve run may start from another directory: fall back to the project root.
        path = Path(__file__).resolve().parent.parent / path
    if not path.exists():
        raise ValueError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


_NESTED = {
    (AppConfig, "models"): ServedModelConfig,
    (ServedModelConfig, "model"): ModelConfig,
    (ServedModelConfig, "engine"): EngineConfig,
    (ServedModelConfig, "replica"): ReplicaConfig,
    (EngineConfig, "speculative"): SpecConfig,
}


def _build(cls: type, data: Any, where: str) -> Any:
    """Construct dataclass ``cls`` from a mapping, naming the path of any unknown or bad key."""
    if isinstance(data, cls):
        return data
    if cls is ModelConfig and isinstance(data, str):
        data = {"source": data}  # `model: some/hub-id` is shorthand
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    kwargs = {}
    for key, value in data.items():
        nested = _NESTED.get((cls, key))
        if nested is SpecConfig and isinstance(value, list):
            value = [_build(nested, item, f"{where}.{key}[{i}]") for i, item in enumerate(value)]
        elif nested is not None and cls is AppConfig:
            if not isinstance(value, list):
                raise ValueError(f"{where}.{key} must be a list")
            value = [_build(nested, item, f"{where}.{key}[{i}]") for i, item in enumerate(value)]
        elif nested is not None:
            value = _build(nested, value, f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # wrong types that reach a comparison
        raise ValueError(f"{where}: {exc}") from exc
