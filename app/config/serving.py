"""How a model is deployed (``replica:``), one served model as a whole, and the app: the models it serves, the
HTTP edge's limits, and reading it all from YAML."""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.config.engine import EngineConfig, SpecConfig, require_int
from app.config.model import ModelConfig
from app.engine.request import SamplingParams, SamplingParamsError

@dataclass
class ReplicaConfig:
    """Ray Serve options of a model's replica deployment (serve_config.yaml may override them too)."""

    num_replicas: int | str = 1  # an integer, or "auto" to autoscale
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None: 1 with device: cuda, else 0 (a replica given no GPU runs device auto on CPU)
    # Ray's memory resource for one replica, in GiB (weights, KV pool, activations): Ray then places replicas by
    # memory too, and KubeRay's autoscaler adds a pod when a replica fits no node. None: not counted.
    memory_gb: float | None = None
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

    @property
    def autoscaled(self) -> bool:
        return self.num_replicas == "auto" or bool(self.autoscaling_config)

    def __post_init__(self) -> None:
        if self.num_replicas != "auto" and (not isinstance(self.num_replicas, int) or isinstance(self.num_replicas, bool)
                                            or self.num_replicas < 1):
            raise ValueError(f"replica.num_replicas must be an integer >= 1 or 'auto', got {self.num_replicas!r}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ValueError("replica.num_cpus and replica.num_gpus must not be negative")
        if self.memory_gb is not None and (isinstance(self.memory_gb, bool) or not isinstance(self.memory_gb, (int, float))
                                           or self.memory_gb <= 0):
            raise ValueError(f"replica.memory_gb must be a number of GiB > 0 (or null), got {self.memory_gb!r}")
        if self.max_ongoing_requests is not None:
            require_int("replica.max_ongoing_requests", self.max_ongoing_requests, minimum=1)
        if self.max_queued_requests != -1:
            require_int("replica.max_queued_requests (or -1: unbounded)", self.max_queued_requests, minimum=1)
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, dict):
            raise ValueError("replica.autoscaling_config must be a mapping of Serve's autoscaling options (or null)")
        if self.autoscaling_config and self.num_replicas not in (1, "auto"):
            raise ValueError(f"replica.num_replicas {self.num_replicas} with replica.autoscaling_config: an autoscaled "
                             "deployment has no fixed count (set num_replicas: auto, and initial_replicas or "
                             "min_replicas in autoscaling_config for where it starts)")
        if (not isinstance(self.target_queue_depth, (int, float)) or isinstance(self.target_queue_depth, bool)
                or self.target_queue_depth <= 0):
            raise ValueError(f"replica.target_queue_depth must be a number > 0, got {self.target_queue_depth!r}")
        if self.max_replicas_per_node is not None:
            require_int("replica.max_replicas_per_node (or null)", self.max_replicas_per_node, minimum=1)


SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",  # an answer's length where a request leaves it unset (chat; completions' default is OpenAI's 16)
)


@dataclass
class ServedModelConfig:
    """One model served by the app: what to load, how to run it, how to deploy it.

    ``default_sampling`` fills the sampling fields a request leaves unset, before the checkpoint's
    generation_config.json values (``model.generation_config``): small models answer better at a low
    temperature than at OpenAI's default of 1.0.
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
        if not isinstance(self.default_sampling, dict):
            raise ValueError(f"default_sampling must be a mapping of sampling fields to values, got {self.default_sampling!r}")
        unknown = sorted(set(self.default_sampling) - set(SAMPLING_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"default_sampling: unknown key(s) {', '.join(unknown)} (known: {', '.join(SAMPLING_DEFAULT_KEYS)})")
        _check_sampling_defaults(self.default_sampling)
        if self.replica.max_ongoing_requests is None:
            engine = self.engine
            self.replica.max_ongoing_requests = engine.max_num_seqs + engine.max_queued_requests + engine.max_batch_size
        # Each request is one ongoing request at the replica while it streams; a smaller cap than the
        # batch window would make Serve hold back requests the batcher is waiting for.
        if self.model.device == "cuda" and self.replica.num_gpus == 0:
            raise ValueError("model.device: cuda with replica.num_gpus: 0: Ray would give the replica no GPU and still let "
                             "it take one unseen; set num_gpus (unset: 1), or device: cpu")
        shares_a_gpu = self.replica.num_gpus is not None and 0 < self.replica.num_gpus < 1
        if shares_a_gpu and not (self.engine.kv_cache_memory_mb or self.engine.num_kv_blocks):
            raise ValueError(
                f"replica.num_gpus {self.replica.num_gpus} shares a GPU: set engine.kv_cache_memory_mb (or num_kv_blocks) "
                "for each model on it; the automatic size takes 80% of the GPU memory free when a replica starts, "
                "which would leave the next replica on that GPU little or nothing")
        holds = self.engine.max_num_seqs + self.engine.max_queued_requests  # one more: the engine's 503
        if self.replica.autoscaled and self.replica.target_queue_depth >= holds:
            raise ValueError(
                f"replica.target_queue_depth ({self.replica.target_queue_depth:g}) must be below what a replica holds "
                f"(engine.max_num_seqs + engine.max_queued_requests = {holds}): a full replica would read as on "
                "target, and the deployment would answer 503s instead of scaling up")
        if self.engine.batching != "none" and self.replica.max_ongoing_requests < self.engine.max_batch_size:
            raise ValueError(
                f"replica.max_ongoing_requests ({self.replica.max_ongoing_requests}) must be at least "
                f"engine.max_batch_size ({self.engine.max_batch_size}), or Serve silently caps every batch; "
                "raise max_ongoing_requests (or leave it unset: batch, queue and one window) or lower max_batch_size"
            )


def _check_sampling_defaults(defaults: dict[str, Any]) -> None:
    """Each default in the range a request's own value must be in: a bad default would fail every request that
    leaves the field unset, blaming the client for a value it never sent."""
    for key, value in defaults.items():
        integer = key in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ValueError(f"default_sampling.{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
        low, high = _REQUEST_RANGES.get(key, (None, None))
        if low is not None and not low <= value <= high:
            raise ValueError(f"default_sampling.{key} must be in [{low}, {high}], as a request's own value, got {value!r}")
    try:
        SamplingParams(**defaults)
    except SamplingParamsError as exc:
        raise ValueError(f"default_sampling.{exc.param}: {exc}") from None


# The API's ranges (app/api/protocol.py), where they are narrower than what the engine computes: a default outside
# them would give a request what it could not ask for itself.
_REQUEST_RANGES = {"temperature": (0, 2), "min_p": (0, 1), "presence_penalty": (-2, 2),
                   "frequency_penalty": (-2, 2), "repetition_penalty": (0.01, 100)}


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
        if "config" in args and not isinstance(args["config"], (str, os.PathLike)):
            raise ValueError(f"args.config must name a YAML file, got {args['config']!r}")
        base = _read_yaml(args.pop("config")) if "config" in args else {}
        return cls.from_dict(_deep_merge(base, args))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        # serve run may start from another directory: fall back to the project root.
        path = Path(__file__).resolve().parents[2] / path
    if not path.exists():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:  # its message names the line and column
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently: a second
    ``engine:`` block would replace the first whole)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                continue  # the parent's error names it, with the line
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


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


# A field declared as one of these (or it "| None") takes only that: YAML's `"false"` is a string, and a string is
# true to Python; an integer is a float, a boolean is neither. Ranges and the other types: each __post_init__.
_SCALARS = {
    "bool": ((bool,), "true or false"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
}


def _check_scalar(where: str, annotation: str, value: Any) -> None:
    kind, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    if kind not in _SCALARS or (optional and value is None):
        return
    types, described = _SCALARS[kind]
    if not isinstance(value, types) or (kind != "bool" and isinstance(value, bool)):
        raise ValueError(f"{where} must be {described}{' (or null)' if optional else ''}, got {value!r}")


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
    annotations = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in data.items():
        _check_scalar(f"{where}.{key}", annotations[key], value)
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
    except (TypeError, ValueError) as exc:  # ranges and combinations (each __post_init__), wrong types in a comparison
        raise ValueError(_located(where, str(exc), known)) from exc


def _located(where: str, message: str, fields: set[str]) -> str:
    """``message`` naming its key from the config's root: "engine.max_num_seqs must..." raised by the engine
    config of ``app.models[1]`` reads "app.models[1].engine.max_num_seqs must..."."""
    path = [re.sub(r"\[[0-9]+\]$", "", part) for part in where.split(".")]  # "models[1]" -> "models"
    for start in range(len(path)):  # the longest end of the path the message begins with
        named = ".".join(path[start:])
        if message.startswith(f"{named}."):
            return where + message[len(named):]
    if message.split(" ", 1)[0].split(".")[0].rstrip(":") in fields:
        return f"{where}.{message}"
    return f"{where}: {message}"
