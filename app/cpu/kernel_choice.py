"""Which Linear kernel runs which row count, decided by timing the candidates on this CPU (``cpu_linear_kernel: auto``).

No kernel wins everywhere. Our fixed-order kernels stream the weights at memory speed for the few rows of a
decode step; oneDNN's blocked GEMM (on AMX tiles where the CPU has them) wins from some row count up (several
times over at prefill sizes on AMX CPUs, docs/performance.md); where that row count lies depends on the CPU, the
thread count and the shape. So at load, for each Linear shape of the model and each row bucket (:data:`BUCKETS`),
``auto`` times every candidate this CPU runs on random weights of that shape (enough distinct copies that they
stream from memory, as a step's weights do) and keeps a challenger only where it beats the incumbent, our
fixed-order kernel, by :data:`MARGIN`, so timing noise cannot flip a choice; a timing that other work on the machine
disturbed (:data:`MIN_CPU_SHARE`) is not kept at all. A shape whose buckets pick two kernels holds two packed copies of its
weights, one per kernel (the log line gives the extra MB).

Decisions are kept in one file per machine (:func:`cache_path`), under a key of the CPU model, its flags, the
thread count, torch's version and the kernels' build: every replica on the machine reads the same decision and a
restart skips the timing. Deleting the file makes the next start measure again.

``engine.batch_invariant: true`` skips all this: one fixed-order kernel for every row count, so a row's bits never
depend on its batch-mates (docs/performance.md says what that costs).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from app.engine import host_cpus

logger = logging.getLogger(__name__)

MARGIN = 0.10  # a challenger must be at least this much faster than the incumbent to replace it,
MIN_CPU_SHARE = 0.8  # of its threads' time the timing must get, else other work skewed it: nothing is kept
MIN_GAIN_S = 5e-6  # and by this much per call: below it (tiny shapes) the timing is mostly call overhead and noise
TIMING_WAIT_S = 120  # at most this long for another process's timing (a model's families take a few seconds each)
STREAM_BYTES = 24 << 20  # distinct weight bytes a timed pass runs over: past the caches, as a model's layers are
COMPUTE_BOUND_ROWS = 128  # from this many rows a product is bound by arithmetic, not by streaming its weights
MAX_COPIES = 32  # about a model's layer count: small shapes stay in cache in a real step too
MAX_TIMED_COLUMNS = 8192  # wider outputs (an LM head) are timed on this many columns: the cost per column is flat there
_REPEATS = 2  # timed passes per candidate and bucket, after one untimed (the fastest counts)
CACHE_FILE = "kernel-choices.json"


@dataclass(frozen=True)
class Bucket:
    """Row counts ``low``..``high`` (None: no upper bound), decided by timing ``timed`` rows."""

    low: int
    high: int | None
    timed: int

    @property
    def name(self) -> str:
        if self.high is None:
            return f"{self.low}+"
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    def holds(self, rows: int) -> bool:
        return rows >= self.low and (self.high is None or rows <= self.high)


# one sequence decoding; a few; a busy decode batch (or a short prompt); prefill chunks and verification steps
BUCKETS = (Bucket(1, 1, 1), Bucket(2, 8, 4), Bucket(9, 64, 32), Bucket(65, None, 256))

# A kernel checked as it is installed (the load-time parity check's reference runs the packed layers too, as
# transformers' modules call them): its answer on seeded rows, a row count of each bucket (the last left out where its product would pass
# CHECK_BUDGET_MACS, a few tens of ms), against the product of the weight it packed. bf16 weights or products are ~0.4%
# off a product (less summed); a wrong kernel far more.
CHECK_ROWS, CHECK_TOLERANCE, CHECK_BUDGET_MACS = tuple(b.low for b in BUCKETS), 0.02, 1 << 28


def computes_its_product(run: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor,
                         bias: torch.Tensor | None) -> tuple[bool, float]:
    """Whether ``run`` (a kernel on its packed ``weight`` [out, in], fp32) computes ``x W^T + b`` within
    CHECK_TOLERANCE (relative L2) at CHECK_ROWS; and the largest error seen."""
    rows = [r for r in CHECK_ROWS if r * weight.numel() <= CHECK_BUDGET_MACS] or [1]
    generator, error = torch.Generator().manual_seed(0), 0.0
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, weight.shape[1], generator=generator)
            exact = torch.nn.functional.linear(x, weight, bias)
            error = max(error, float((run(x).float() - exact).norm() / exact.norm().clamp_min(1e-12)))
    return error <= CHECK_TOLERANCE, error


@dataclass(frozen=True)
class LinearShape:
    """A packed weight's shape as the timing needs it: ``bf16_exact`` weights are stored at half the bytes by our
    kernel, so they are timed that way; ``weight_bytes`` per weight sets how many copies stream from memory (0.5 for
    4-bit codes)."""

    out_features: int
    in_features: int
    bf16_exact: bool = False
    weight_bytes: float = 4.0

    @property
    def key(self) -> str:
        return f"{self.out_features}x{self.in_features}" + (" bf16-exact" if self.bf16_exact else "")


def decide(times: dict[str, dict[str, float]], incumbent: str, margin: float = MARGIN,
           min_gain_s: float = MIN_GAIN_S) -> dict[str, str]:
    """Per bucket name, the kernel to run: the fastest, if it beats ``incumbent`` by ``margin`` (and ``min_gain_s``),
    else the incumbent.

    ``times``: bucket name -> kernel name -> seconds. A bucket the incumbent was not timed on takes its fastest."""
    choice = {}
    for bucket, by_kernel in times.items():
        fastest = min(by_kernel, key=by_kernel.get)
        if incumbent in by_kernel:
            gain = by_kernel[incumbent] - by_kernel[fastest]
            if gain < by_kernel[incumbent] * margin or gain < min_gain_s:
                fastest = incumbent
        choice[bucket] = fastest
    return choice


def capped_at_more_rows(times: dict[str, dict[str, float]], kernel: str, buckets=BUCKETS) -> dict[str, dict[str, float]]:
    """``times`` with ``kernel``'s time in each bucket capped by its time in every bucket of more rows.

    A kernel runs fewer rows over the same weights in no more time, so a higher time at fewer rows is a disturbed
    timing, which would otherwise hand that bucket to a challenger (docs/performance.md). Applied to the incumbent
    only, the cap can keep it, never promote a challenger."""
    capped = {name: dict(by_kernel) for name, by_kernel in times.items()}
    floor = math.inf
    for bucket in reversed(buckets):
        by_kernel = capped.get(bucket.name, {})
        if kernel in by_kernel:
            floor = by_kernel[kernel] = min(floor, by_kernel[kernel])
    return capped


def time_candidates(shape: LinearShape, kernels: dict[str, object], buckets=BUCKETS,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Seconds per call of each kernel (name -> LinearKernel) on ``shape``, per bucket, on random weights.

    Each timed pass runs over enough distinct weight copies to stream ~:data:`STREAM_BYTES` (a decode step reads
    weights from memory, not cache; from :data:`COMPUTE_BOUND_ROWS` rows, where each weight byte serves that many
    products, one copy), the kernels alternate, and the fastest of :data:`_REPEATS` passes counts."""
    columns = min(shape.out_features, MAX_TIMED_COLUMNS)
    copies = min(MAX_COPIES, max(1, math.ceil(STREAM_BYTES / (columns * shape.in_features * shape.weight_bytes))))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(columns, shape.in_features, generator=generator) / math.sqrt(shape.in_features)
               for _ in range(copies)]
    if shape.bf16_exact:
        weights = [w.to(torch.bfloat16).float() for w in weights]
    kernels = _working(kernels, weights[0], columns)
    packed = {name: [kernel.pack(w) for w in weights] for name, kernel in kernels.items()}
    times: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for bucket in buckets:
            x = torch.randn(bucket.timed, shape.in_features, generator=generator)
            best = {name: math.inf for name in kernels}
            used = 1 if bucket.timed >= COMPUTE_BOUND_ROWS else copies
            for attempt in range(_REPEATS + 1):
                for name, kernel in kernels.items():
                    start = clock()
                    for weight in packed[name][:used]:
                        kernel.apply(x, weight, None, columns)
                    if attempt:  # the first pass warms caches and oneDNN's primitive cache
                        best[name] = min(best[name], (clock() - start) / used)
            times[bucket.name] = best
    return times


def _working(kernels: dict[str, object], weight: torch.Tensor, columns: int) -> dict[str, object]:
    """The candidates that pack and run here: one that raises (an op this torch build lacks on this CPU) is left
    out of the bake-off, not fatal to the start."""
    working = {}
    with torch.inference_mode():
        for name, kernel in kernels.items():
            try:
                kernel.apply(torch.zeros(1, weight.shape[1]), kernel.pack(weight), None, columns)
            except Exception as exc:  # noqa: BLE001 - any failure rules the candidate out
                logger.warning("Linear kernel %s fails on this machine (%s: %s): left out of the timing", name, type(exc).__name__, exc)
                continue
            working[name] = kernel
    return working


def choose(shapes: list[LinearShape], kernels: dict[str, object], incumbent: str, family: str,
           kernel_build: str | None, cache: ChoiceCache | None = None) -> dict[str, dict[str, str]]:
    """Per shape key, bucket name -> kernel name: from this machine's cache, else timed now (and logged, and cached
    unless other work on the machine disturbed the timing: then the incumbent everywhere, timed again next start)."""
    by_key = {shape.key: shape for shape in shapes}
    timed = f"{family}, rows {'/'.join(str(bucket.timed) for bucket in BUCKETS)}"  # a change to what is timed: timed again
    return choose_timed(list(by_key), lambda key: time_candidates(by_key[key], kernels), incumbent, timed, kernel_build,
                        lambda entry: _usable(entry, kernels), cache, "Linear kernels",
                        lambda times: decide(capped_at_more_rows(times, incumbent), incumbent))


def choose_timed(keys: list[str], timer: Callable[[str], dict[str, dict[str, float]]], incumbent: str, family: str,
                 kernel_build: str | None, usable: Callable[[dict | None], bool], cache: ChoiceCache | None = None,
                 what: str = "kernels", decider: Callable[[dict[str, dict[str, float]]], dict[str, str]] | None = None
                 ) -> dict[str, dict[str, str]]:
    """The bake-off for any op family: per key, bucket -> the candidate ``decider`` keeps (default: :func:`decide`
    with ``incumbent``), read from the cache where ``usable`` accepts its entry, else from ``timer(key)`` (bucket ->
    candidate -> seconds), then cached with the times as measured."""
    decider = decider or (lambda times: decide(times, incumbent))
    cache = cache or ChoiceCache()
    machine = machine_key(kernel_build)

    def cached(key: str) -> dict | None:
        entry = _decided_again(cache.get(machine, family, key), decider)
        return entry if usable(entry) else None

    decisions = {key: entry["choice"] for key in keys if (entry := cached(key)) is not None}
    if len(decisions) == len(keys):
        return decisions
    with cache.timing():  # one timing at a time on the machine: replicas starting together would disturb each other's
        measured = {}
        started, cpu_started = time.perf_counter(), time.process_time()
        for key in (key for key in keys if key not in decisions):
            entry = cached(key)  # timed by another replica while this one waited
            if entry is None:
                # decided on the times as cached (0.1 us), so a replica reading the cache decides as this one did
                us = {bucket: {name: round(s * 1e6, 1) for name, s in by_kernel.items()} for bucket, by_kernel in timer(key).items()}
                entry = {"choice": decider(_seconds(us)), "measured": time.strftime("%Y-%m-%d %H:%M"), "us": us}
                measured[key] = entry
            decisions[key] = entry["choice"]
        if not measured:
            return decisions
        return _kept(decisions, measured, cache, machine, family, incumbent, what, time.perf_counter() - started,
                     time.process_time() - cpu_started)


def _kept(decisions: dict, measured: dict, cache: "ChoiceCache", machine: str, family: str, incumbent: str, what: str,
          wall: float, cpu: float) -> dict[str, dict[str, str]]:
    """The decisions, cached and logged where the timing had the CPU to itself; else the incumbent where timed now."""
    share = cpu / (wall * _cpus_for_threads())
    if share < MIN_CPU_SHARE:
        logger.warning("%s timing disturbed by other work on this machine (it had %.0f%% of its %d threads' time): "
                       "our kernels kept everywhere; timed again at the next start", what, 100 * share, torch.get_num_threads())
        return {key: _incumbent_where_it_ran(measured[key], incumbent) if key in measured else choice
                for key, choice in decisions.items()}
    cache.put(machine, family, measured)
    logger.info("%s timed on this CPU in %.1f s (%s, %.0f%% of its threads' time, cached in %s):\n%s", what, wall,
                family, 100 * share, cache.path, describe_table(measured))
    return decisions


def _incumbent_where_it_ran(entry: dict, incumbent: str) -> dict[str, str]:
    """Per bucket the incumbent, or where it failed here (left out of the timing) the fastest that ran."""
    return {bucket: incumbent if incumbent in times else min(times, key=times.get) for bucket, times in entry["us"].items()}


def _cpus_for_threads() -> float:
    """The CPU time per second the timing's threads can get: their number, at most the container's CPU quota (a
    500m pod's one thread gets half a CPU, which is not other work disturbing it)."""
    quota = host_cpus.cgroup_cpu_quota()
    return min(torch.get_num_threads(), quota) if quota is not None else torch.get_num_threads()


def _decided_again(entry: dict | None, decider: Callable[[dict[str, dict[str, float]]], dict[str, str]]) -> dict | None:
    """A cached entry with today's rule applied to its times as measured (a rule change needs no timing); None for
    an entry this code did not write (a hand edit, another tool): timed again."""
    if entry is None or "us" not in entry:
        return None
    try:
        return {**entry, "choice": decider(_seconds(entry["us"]))}
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _seconds(us: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {bucket: {name: t * 1e-6 for name, t in by_kernel.items()} for bucket, by_kernel in us.items()}


def describe_table(entries: dict[str, dict]) -> str:
    """One line per shape and bucket: each candidate's time per call, the chosen one marked."""
    lines = []
    for shape, entry in entries.items():
        for bucket, by_kernel in entry["us"].items():
            cells = [f"{'*' if name == entry['choice'][bucket] else ' '}{name} {us:9.1f} us" for name, us in by_kernel.items()]
            rows = " rows" if bucket[0].isdigit() else ""
            lines.append(f"  {shape:>22} {bucket:>5}{rows}: " + " | ".join(cells))
    return "\n".join(lines)


def _usable(entry: dict | None, kernels: dict[str, object]) -> bool:
    """A cached entry decides every bucket, each with a kernel still among the candidates."""
    choice = entry.get("choice") if isinstance(entry, dict) else None
    return (isinstance(choice, dict) and set(choice) == {bucket.name for bucket in BUCKETS}
            and all(isinstance(name, str) and name in kernels for name in choice.values()))


def machine_key(kernel_build: str | None) -> str:
    """What a decision depends on besides the shape: the CPU, its thread count and the libraries doing the work."""
    parts = [_cpu_model(), " ".join(_cpu_flags()), f"threads={torch.get_num_threads()}", f"torch={torch.__version__}",
             f"onednn={torch.backends.mkldnn.is_available()}", f"kernels={kernel_build}",
             *(f"{name}={os.environ[name]}" for name in _ONEDNN_ISA_VARIABLES if os.environ.get(name))]
    return " | ".join(parts)


def cache_path() -> Path:
    from app.models.registry import cache_dir

    return cache_dir() / CACHE_FILE


class ChoiceCache:
    """The decisions of this machine, in one JSON file: machine key -> family -> shape key -> entry."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_path()

    def get(self, machine: str, family: str, shape: str) -> dict | None:
        node = self._read()
        for part in (machine, family, shape):
            node = node.get(part) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else None

    def put(self, machine: str, family: str, entries: dict[str, dict]) -> None:
        """Add ``entries`` (shape key -> entry) under a lock: replicas starting together merge, never clobber."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                data = self._read()
                if not isinstance(data.get(machine), dict):  # what this code did not write is replaced
                    data[machine] = {}
                if not isinstance(data[machine].get(family), dict):
                    data[machine][family] = {}
                data[machine][family].update(entries)
                partial = self.path.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(partial, self.path)
        except OSError as exc:  # a read-only home: the decision holds for this process only
            logger.warning("could not save the kernel choice to %s (%s): the next start measures again", self.path, exc)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @contextlib.contextmanager
    def timing(self, wait_s: float = TIMING_WAIT_S):
        """Held while a process on this machine times candidates; the next waits for it (up to ``wait_s``, then times
        anyway) and then finds in the cache what it would have timed, where the two shared it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_suffix(".timing.lock"), "w")
        except OSError:  # a read-only home: nothing is cached either
            yield
            return
        with lock:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.warning("another process has been timing kernels for %.0f s: timing beside it", wait_s)
                        break
                    time.sleep(0.05)
            yield

    @contextlib.contextmanager
    def _locked(self):
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


# oneDNN reads its ISA cap under either prefix (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: AMX off, for an A/B)
_ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# What names the CPU in /proc/cpuinfo: x86's model name with its family and model numbers (a VM may show only "AMD
# EPYC"), and ARM's implementer and part numbers (no model name there)
_MODEL_FIELDS = ("model name", "cpu family", "model", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cpu_model() -> str:
    fields = host_cpus.cpuinfo_fields()
    named = [f"{name}={fields[name]}" for name in _MODEL_FIELDS if name in fields]
    return " ".join(named) or platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """The flags that change which kernel can win (ISA extensions for matrix products; ARM's "Features" too)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert",
              "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2", "sme")
    have = host_cpus.cpu_flags() or frozenset()
    return [flag for flag in wanted if flag in have]
