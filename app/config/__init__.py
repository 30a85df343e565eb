"""Dataclass configs for the app, validated at construction and read from YAML.

Every config raises ``ValueError`` with a message a user can act on. ``AppConfig.from_args`` is
what ``deployments/builder.py`` calls with the application ``args`` of ``serve_config.yaml``:
an optional ``config:`` YAML file, deep-merged with whatever else the args say.
"""

from app.config.engine import (
    BATCHING_MODES,
    CPU_ATTENTION_KERNELS,
    CPU_DECODER_LAYERS,
    CPU_GPTQ_KERNELS,
    CPU_LINEAR_KERNELS,
    CPU_NORM_KERNELS,
    CPU_ROTARY_KERNELS,
    KV_CACHE_DTYPES,
    SPEC_DRAFTERS,
    EngineConfig,
    SpecConfig,
)
from app.config.model import DEVICES, DTYPE_ALIASES, DTYPES, QUANTIZATION_METHODS, SERVED_NAME_PATTERN, ModelConfig
from app.config.serving import SAMPLING_DEFAULT_KEYS, AppConfig, ReplicaConfig, ServedModelConfig

__all__ = [
    "AppConfig", "ServedModelConfig", "ModelConfig", "EngineConfig", "SpecConfig", "ReplicaConfig",
    "BATCHING_MODES", "CPU_ATTENTION_KERNELS", "CPU_DECODER_LAYERS", "CPU_GPTQ_KERNELS", "CPU_LINEAR_KERNELS",
    "CPU_NORM_KERNELS", "CPU_ROTARY_KERNELS", "KV_CACHE_DTYPES", "SPEC_DRAFTERS", "DEVICES", "DTYPE_ALIASES", "DTYPES",
    "QUANTIZATION_METHODS", "SERVED_NAME_PATTERN", "SAMPLING_DEFAULT_KEYS",
]
