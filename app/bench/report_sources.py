"""The report's result files read as sources: what produced each, when and on which CPU class (the report cites every
figure's source). Standard library only."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_COMMANDS = {"compare": "python -m app.bench compare", "hf": "python -m app.bench hf", "quant": "python -m app.bench quant"}
# A command's paths as anyone re-running it would give them: the checkout's results from its root, the model cache
_CHECKOUT_RESULTS = re.compile(r"(?<![\w$])/\S*?/(results/\S*)")
_MODEL_CACHE = re.compile(r"(?<![\w$])/\S*?/\.cache/llm-serve(?=/|\s|$)")


def portable(command: str) -> str:
    """``command`` without this machine's paths: results/... from the checkout's root, $LLM_SERVE_CACHE/...."""
    return _MODEL_CACHE.sub("$LLM_SERVE_CACHE", _CHECKOUT_RESULTS.sub(r"\1", command))


@dataclass
class Source:
    index: int
    path: Path
    data: dict
    kind: str
    cpu_class: str

    @property
    def ref(self) -> str:
        return f"[{self.index}]"

    @property
    def command(self) -> str:
        if self.data.get("command"):
            return portable(self.data["command"])
        default = DEFAULT_COMMANDS.get(self.kind)
        return f"not recorded (made by `{default}`)" if default else "not recorded"


def kind_of(data: dict) -> str:
    if "servers" in data:
        return "peer"
    if "levels" in data:
        return "sweep"
    if "serving" in data or "fidelity" in data:
        return "quant"
    if "generate_batch" in data:
        return "hf"
    if "modes" in data and "config" in data:
        return "compare"
    if "modes" in data:
        return "engine"
    if "num_requests" in data and "spec" in data:
        return "load"
    return "other"


def load_sources(paths: list[Path], cpu_classes: list[str] = ()) -> list[Source]:
    """Each file with its kind and CPU class (``cpu_classes``: ``[FILE=]FLAGS`` for files that did not record it)."""
    given: dict[str, str] = {}
    for entry in cpu_classes:
        name, _, flags = entry.rpartition("=")
        given[name] = flags
    sources = []
    for index, path in enumerate(paths, 1):
        data = json.loads(Path(path).read_text())
        recorded = (data.get("machine") or {}).get("cpu_class")
        if recorded is not None:
            cpu = cpu_class_name(recorded)
        elif Path(path).name in given or "" in given:
            flags = given.get(Path(path).name, given.get(""))
            cpu = f"{cpu_class_name(flags.replace(',', ' ').split())} (given to the report; the file predates machine.cpu_class)"
        else:
            cpu = "not recorded"
        sources.append(Source(index, Path(path), data, kind_of(data), cpu))
    return sources


def cpu_class_name(flags: list[str]) -> str:
    """The CPU class that picks our paths, from the flags ``machine.cpu_class`` records."""
    flags = sorted(set(flags))
    if "amx_bf16" in flags:
        name = "AMX"
    elif "avx512_bf16" in flags:
        name = "AVX-512 with avx512_bf16"
    elif "avx512f" in flags:
        name = "AVX-512 without native bf16"
    elif "avx2" in flags:
        name = "AVX2-only (no native bf16)"
    else:
        return "without AVX2"
    return f"{name} ({', '.join(flags)})"
