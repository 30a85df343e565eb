"""Third-party log lines a user cannot act on, silenced where they are emitted (each library's own logger), so a
start shows our own lines: imported first by ``app`` (every process that serves a model imports it first).

- torchao (imported by GPTQModel): "Failed to load .../torchao/_C_cutlass_90a.abi3.so" and "..._C_mxfp8...":
  CUDA kernels a CPU build cannot load and a CPU never needs.
- torch's pytree: "<enum 'KernelPreference'> is an Enum subclass ... register_constant() ... deprecated",
  said of torchao's own registrations, once per enum at import.
- bitsandbytes' CPU backend: "Failed to load CPU gemm_4bit_forward from kernels-community": an optional kernel
  fetched from the hub, which this machine cannot reach; bitsandbytes falls back to its own.
- transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised as GPTQModel loads a model.

Errors from these loggers still show.
"""

import logging
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def silence_known_noise() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
