"""Turn a Hugging Face causal LM into a GPTQ checkpoint with GPTQModel (the maintained successor of
auto-gptq, which no longer imports with transformers 5).

The result is a standard GPTQ checkpoint (``config.json`` carries ``quantization_config``) that
transformers, vLLM and SGLang load; this server serves it with ``model.quantization: gptq``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

BITS = (2, 3, 4, 8)
DEFAULT_CALIBRATION = "calibration.jsonl"  # app/models/data: 48 varied texts written for this project


class GPTQSettingsError(ValueError):
    """The GPTQ settings cannot quantize this model; the message says which value to change."""


@dataclass(frozen=True)
class GPTQSettings:
    bits: int = 4
    group_size: int = 64  # must divide every quantized layer's input size; -1: one group per column
    desc_act: bool = False  # act-order: slightly better accuracy, slower kernels
    sym: bool = True
    damp_percent: float = 0.05
    offload_to_disk: bool = True  # GPTQModel's: finished layers wait on disk (less memory; loses an output layer not named lm_head)

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise GPTQSettingsError(f"bits must be one of {', '.join(map(str, BITS))}, got {self.bits!r}")
        if self.group_size != -1 and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise GPTQSettingsError(f"group_size must be a positive integer or -1, got {self.group_size!r}")
        if not 0 < self.damp_percent < 1:
            raise GPTQSettingsError(f"damp_percent must be between 0 and 1, got {self.damp_percent!r}")


def check_group_size(source: str, group_size: int, **hub_kwargs) -> None:
    """Every Linear in the decoder layers must split into whole groups; say which does not."""
    if group_size == -1:
        return
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, **hub_kwargs)
    with init_empty_weights():  # shapes only: no memory, no weights read
        skeleton = AutoModelForCausalLM.from_config(config)
    sizes = {
        module.in_features
        for name, module in skeleton.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
    }
    bad = sorted(size for size in sizes if size % group_size)
    if bad:
        good = [g for g in (128, 64, 32) if all(size % g == 0 for size in sizes)]  # what torch's int4 matmul takes
        hint = f"use group_size {good[0]}" if good else "use group_size -1 (one group per column)"
        raise GPTQSettingsError(
            f"group_size {group_size} does not divide the input size of this model's layers "
            f"({', '.join(map(str, bad))} of {sorted(sizes)}); {hint}"
        )


def load_calibration(path: str | os.PathLike | None = None, limit: int | None = None) -> list[str]:
    """Calibration texts: a .jsonl file of {"text": ...} lines, or plain text split on blank lines.

    Without a path, the project's own set (app/models/data/calibration.jsonl)."""
    if path is None:
        raw = resources.files("app.models").joinpath("data", DEFAULT_CALIBRATION).read_text(encoding="utf-8")
        suffix = ".jsonl"
    else:
        raw, suffix = Path(path).read_text(encoding="utf-8"), Path(path).suffix
    if suffix == ".jsonl":
        texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    else:
        texts = [block.strip() for block in raw.split("\n\n") if block.strip()]
    if not texts:
        raise GPTQSettingsError(f"calibration file {path} holds no texts")
    return texts[:limit] if limit else texts


def quantize_gptq(
    source: str, output: str | os.PathLike, settings: GPTQSettings, calibration: list[str], **hub_kwargs
) -> Path:
    """Quantize ``source`` into ``output`` (written whole or not at all). Takes ~2-3 min for 135M on 2 cores."""
    check_group_size(source, settings.group_size, **hub_kwargs)
    # GPTQModel's CPU pool needs at least two workers (its loader asks for two); its default gives 1 on 2 cores.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, (os.cpu_count() or 2) // 2)))
    from gptqmodel import GPTQModel, QuantizeConfig

    output = Path(output)
    partial = output.with_name(output.name + f".partial-{os.getpid()}")
    started = time.monotonic()
    logger.info("GPTQ %s: loading (bits %d, group_size %d, desc_act %s)", source, settings.bits, settings.group_size, settings.desc_act)
    # GPTQModel's group-aware activation order (its default without desc_act) needs groups: off for one group per column
    grouped = {} if settings.group_size > 0 else {"act_group_aware": False}
    config = QuantizeConfig(
        bits=settings.bits, group_size=settings.group_size, desc_act=settings.desc_act,
        sym=settings.sym, damp_percent=settings.damp_percent, offload_to_disk=settings.offload_to_disk, **grouped,
    )
    model = GPTQModel.load(source, config, **hub_kwargs)
    logger.info("GPTQ %s: calibrating on %d texts, layer by layer", source, len(calibration))
    model.quantize(calibration, batch_size=1)
    logger.info("GPTQ %s: quantized in %.0fs; writing %s", source, time.monotonic() - started, output)
    try:
        model.save(str(partial))
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)  # never a half-written checkpoint left behind
        if isinstance(exc, FileNotFoundError) and settings.offload_to_disk:  # its offload keeps lm_head alone (NeoX: embed_out)
            raise GPTQSettingsError(f"GPTQModel lost a layer it had offloaded to disk ({exc}); quantize again with "
                                    "--no-offload (the layers then stay in memory)") from exc
        raise
    (partial / "quant_log.csv").unlink(missing_ok=True)  # per-layer losses: a log, not part of the checkpoint
    _replace(partial, output)
    logger.info("GPTQ %s: done in %.0fs", source, time.monotonic() - started)
    return output


def _replace(partial: Path, output: Path) -> None:
    """Move a finished checkpoint into place, so a crash never leaves a half-written one behind."""
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.exists():
        shutil.rmtree(output)
    partial.rename(output)
