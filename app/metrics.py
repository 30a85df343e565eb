"""Serving metrics in Prometheus' text format, named after vLLM's (``vllm:*`` -> ``llm_serve:*``).

Each process hosting a model keeps one :class:`RequestMetrics` per served name (latency histograms and
request/token counters, recorded by ``OpenAIServing`` as answers stream) next to the engine's own counters
(``LLMEngine.stats``: running/waiting, KV usage, prefix cache, preemptions, tokens per step, speculation).
The ingress gathers both for every model and renders them with :func:`render` for ``GET /metrics``.
Plain Python, no client library: the format is small and stable.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Latency buckets in seconds: vLLM's (vllm/v1/metrics/buckets.py), so that its dashboards' quantiles read the same;
# their top bounds leave room for a CPU replica behind a long queue (a value past the last bound reads as that bound).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# A request's wait for its first step and its prefill: milliseconds when idle (finer than vLLM's, which start at
# 0.3 s), up to vLLM's top bound behind a long queue.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Every reason's series exists from the start at 0 (as vLLM's): Prometheus' rate() and increase() see no rise in a
# series' first sample, so a first rejection after a restart would raise no alert.
REJECTION_REASONS = ("overloaded", "draining", "stopped", "queue_timeout")
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes one (``le`` upper bounds, then +Inf)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total, "count": self.count}


@dataclass
class RequestMetrics:
    """What one served name's answers looked like: latencies, outcomes and token counts."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # the engine's phases of a request: waiting for its first step, prefill until its first token, decode after
    queue: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    # requests turned away before the engine took them (overloaded, draining, stopped), or that had no first token
    # within engine.max_queue_time_s (queue_timeout): never served, so in no latency or token figure above (a
    # timed-out request's wait in the queue figure alone)
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))

    def record_rejection(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def record_queue_timeout(self, waited_s: float) -> None:
        """A request that had no first token within engine.max_queue_time_s (a 503): refused, after a wait that
        the queue figure shows (overload's, which its alerts watch for)."""
        self.record_rejection("queue_timeout")
        self.queue.observe(waited_s)

    def record_output(self, timing: "RequestTiming", now: float, count: int, steps: int = 1) -> None:
        """As each output arrives: its prompt's tokens and TTFT with the first, then a gap per engine step (vLLM's; a
        paced chunk of several steps spreads its gap over them), so a long stream shows in the rates and a stalled one
        in the latencies while it runs."""
        if timing.outputs == 0:
            self.prompt_tokens += timing.prompt_tokens  # its prefill is done
        if count > 0 and timing.first_token_s is None:
            self.ttft.observe(now - timing.arrival_s)  # the first chunk's other steps came with it: no gap to show
        elif count > 0:
            for _ in range(steps):
                self.inter_token.observe((now - timing.last_token_s) / steps)
        self.generation_tokens += max(count, 0)

    def record(self, timing: "RequestTiming") -> None:
        """A request that ended (normally, aborted or failed): its whole figures."""
        if timing.output_tokens > 1:  # vLLM's: the decode's time over the tokens after the first
            self.time_per_output_token.observe((timing.last_token_s - timing.first_token_s) / (timing.output_tokens - 1))
        self.e2e.observe(timing.end_s - timing.arrival_s)
        for key, histogram in (("queue_s", self.queue), ("prefill_s", self.prefill), ("decode_s", self.decode)):
            if key in timing.phase_times:
                histogram.observe(max(timing.phase_times[key], 0.0))
        self.finished[timing.finish_reason] = self.finished.get(timing.finish_reason, 0) + 1

    def to_dict(self) -> dict:
        return {
            "time_to_first_token_seconds": self.ttft.to_dict(),
            "inter_token_latency_seconds": self.inter_token.to_dict(),
            "request_time_per_output_token_seconds": self.time_per_output_token.to_dict(),
            "e2e_request_latency_seconds": self.e2e.to_dict(),
            "request_queue_time_seconds": self.queue.to_dict(),
            "request_prefill_time_seconds": self.prefill.to_dict(),
            "request_decode_time_seconds": self.decode.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "request_success": dict(self.finished),
            "request_rejected": dict(self.rejected),
        }


@dataclass
class RequestTiming:
    """One request's clock, filled in as its outputs arrive (monotonic seconds); each output goes to ``sink``'s
    figures at once, the whole request's at its end."""

    arrival_s: float
    prompt_tokens: int
    sink: RequestMetrics | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    end_s: float = 0.0
    outputs: int = 0
    output_tokens: int = 0
    finish_reason: str = "abort"
    phase_times: dict[str, float] = field(default_factory=dict)  # the engine's queue/prefill/decode seconds

    def tokens(self, now: float, count: int, steps: int = 1) -> None:
        """An output of ``count`` new tokens from ``steps`` engine steps arrived at ``now`` (one streamed chunk; 0
        tokens: a prompt scored alone)."""
        if self.sink is not None:
            self.sink.record_output(self, now, count, steps)
        self.outputs += 1
        if count <= 0:
            return
        self.output_tokens += count
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now

    def finish(self, now: float, reason: str) -> None:
        self.end_s, self.finish_reason = now, reason


# Engine counters (LLMEngine.stats keys) exported as gauges or counters, with their Prometheus names.
ENGINE_GAUGES = {
    "num_running": "num_requests_running",
    "num_waiting": "num_requests_waiting",
    "kv_usage": "kv_cache_usage_perc",
    "step_token_cap": "engine_step_token_cap",
}
ENGINE_COUNTERS = {
    "prefix_cache_queried_tokens": "prefix_cache_queries",
    "prefix_cache_hit_tokens": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "num_steps": "engine_steps",
    "num_steps_run_apart": "engine_steps_run_apart",
    "spec_num_drafts": "spec_decode_num_drafts",
    "spec_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_num_accepted_tokens": "spec_decode_num_accepted_tokens",
}
PREFIX = "llm_serve:"
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds")


def render(models: dict[str, dict]) -> str:
    """Prometheus text for ``{served name: {"requests": RequestMetrics.to_dict(), "engine": LLMEngine.stats()}}``."""
    lines: list[str] = []
    families: dict[str, tuple[str, list[str]]] = {}

    def add(name: str, kind: str, sample_lines: list[str]) -> None:
        families.setdefault(name, (kind, []))[1].extend(sample_lines)

    for model, data in models.items():
        label = f'model_name="{_escape(model)}"'
        engine, requests = data.get("engine") or {}, data.get("requests") or {}
        for key, name in ENGINE_GAUGES.items():
            if key in engine:
                add(PREFIX + name, "gauge", [f"{PREFIX}{name}{{{label}}} {float(engine[key])}"])
        for key, name in ENGINE_COUNTERS.items():
            if key in engine:
                add(PREFIX + name + "_total", "counter", [f"{PREFIX}{name}_total{{{label}}} {float(engine[key])}"])
        for pos, count in enumerate(engine.get("spec_num_accepted_tokens_per_pos") or []):
            name = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
            add(name, "counter", [f'{name}{{{label},position="{pos}"}} {float(count)}'])
        if "step_tokens" in engine:
            add(PREFIX + "iteration_tokens_total", "histogram", _histogram_lines(PREFIX + "iteration_tokens_total", label, engine["step_tokens"]))
        for key in HISTOGRAMS:
            if key in requests:
                add(PREFIX + key, "histogram", _histogram_lines(PREFIX + key, label, requests[key]))
        for key in ("prompt_tokens", "generation_tokens"):
            if key in requests:
                add(PREFIX + key + "_total", "counter", [f"{PREFIX}{key}_total{{{label}}} {float(requests[key])}"])
        for reason, count in (requests.get("request_success") or {}).items():
            name = PREFIX + "request_success_total"
            add(name, "counter", [f'{name}{{{label},finished_reason="{_escape(reason)}"}} {float(count)}'])
        for reason, count in (requests.get("request_rejected") or {}).items():
            name = PREFIX + "request_rejected_total"
            add(name, "counter", [f'{name}{{{label},reason="{_escape(reason)}"}} {float(count)}'])
    for name, (kind, samples) in families.items():
        lines += [f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, label: str, histogram: dict) -> list[str]:
    lines, cumulative = [], 0
    for bound, count in zip([*histogram["buckets"], float("inf")], histogram["counts"]):
        cumulative += count
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(cumulative)}')
    lines.append(f"{name}_sum{{{label}}} {float(histogram['sum'])}")
    lines.append(f"{name}_count{{{label}}} {float(histogram['count'])}")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
