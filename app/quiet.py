"""Third-party log lines a user cannot act on, silenced where they are emitted (each library's own logger), so a
start shows our own lines: imported first by ``app`` (every process that serves a model imports it first).

- torchao (imported by GPTQModel): "Failed to load .../torchao/_C_cutlass_90a.abi3.so" and "..._C_mxfp8...":
  CUDA kernels a CPU build cannot load and a CPU never needs.
- torch's pytree: "<enum 'KernelPreference'> is an Enum subclass ... register_constant() ... deprecated",
  said of torchao's own registrations, once per enum at import.
- bitsandbytes' CPU backend: "Failed to load CPU gemm_4bit_forward from kernels-community": an optional kernel
  fetched from the hub, which this machine cannot reach; bitsandbytes falls back to its own.
- transformers' FutureWarning "`is_gradient_checkpointing` is deprecated", raised as GPTQModel loads a model.
- GPTQModel (any process that loads a GPTQ checkpoint imports it): "Python GIL is enabled: Multi-gpu quant
  acceleration ... sub-optimal" (its own switch, ``GPTQMODEL_DISABLE_GIL_WARNING``), and at INFO its startup
  banner (an ASCII logo and version table) and progress lines, through its ``logbar`` logger
  (``quiet_gptqmodel``, called before a GPTQ model loads).

- transformers' "`loss_type=None` was set in the config but it is unrecognized", as GPTQModel reads a model's
  ``loss_function``: a training loss, which serving never computes (that one message only).

Errors from these loggers still show (warnings too, for GPTQModel).
"""

import logging
import os
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in str(record.msg)


def silence_known_noise() -> None:
    os.environ.setdefault("GPTQMODEL_DISABLE_GIL_WARNING", "1")  # read as gptqmodel imports, here or in a child
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    logging.getLogger("transformers.modeling_utils").addFilter(_DropMessage("was set in the config but it is unrecognized"))


def quiet_gptqmodel() -> None:
    """GPTQModel's logger at WARNING before GPTQModel first logs: ``LogBar.shared()`` sets INFO only when it
    creates the shared logger, so creating it here first makes the level stick."""
    from logbar import LogBar

    LogBar.shared().setLevel(logging.WARNING)
