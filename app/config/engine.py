"""How a replica's engine runs: batching, scheduling, the KV cache, the CPU fast path and speculative decoding
(``engine:`` of a served model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.config.model import DTYPE_ALIASES, SERVED_NAME_PATTERN

BATCHING_MODES = ("none", "dynamic", "continuous")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")  # auto: the dtype the model computes in (bf16 products: bfloat16)
# The CPU fast path (app/cpu/): each part can be turned back to torch's ops.
CPU_LINEAR_KERNELS = ("auto", "avx2", "avx512-bf16", "onednn", "onednn-bf16", "torch")  # app/cpu/linear_kernels.py
CPU_ATTENTION_KERNELS = ("auto", "kernel", "torch")  # app/cpu/attention.py, app/engine/attention_choice.py
CPU_NORM_KERNELS = ("auto", "torch")  # app/cpu/norm.py
CPU_ROTARY_KERNELS = ("auto", "torch")  # app/cpu/rotary.py
CPU_DECODER_LAYERS = ("auto", "torch")  # app/cpu/decoder.py
CPU_GPTQ_KERNELS = ("auto", "torch", "int4-avx512-bf16", "torch-int4", "dequant-fp32", "dequant-bf16")  # app/cpu/gptq.py
_CPU_CHOICES = {
    "cpu_linear_kernel": CPU_LINEAR_KERNELS, "cpu_attention_kernel": CPU_ATTENTION_KERNELS, "cpu_norm_kernel": CPU_NORM_KERNELS,
    "cpu_rotary_kernel": CPU_ROTARY_KERNELS, "cpu_decoder_layer": CPU_DECODER_LAYERS, "cpu_gptq_kernel": CPU_GPTQ_KERNELS,
}


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
        require_int("engine.speculative.num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        require_int("engine.speculative.ngram_min", self.ngram_min, minimum=1)
        require_int("engine.speculative.ngram_max (at least ngram_min)", self.ngram_max, minimum=self.ngram_min)
        if not isinstance(self.saturation_tokens, (int, float)) or self.saturation_tokens <= 0:
            raise ValueError("engine.speculative.saturation_tokens must be a number > 0")
        if not isinstance(self.max_draft_wait_ms, (int, float)) or self.max_draft_wait_ms < 0:
            raise ValueError("engine.speculative.max_draft_wait_ms must be a number >= 0")
        if not isinstance(self.adaptive, bool):
            raise ValueError("engine.speculative.adaptive must be true or false")
        if self.served_name is not None and (not isinstance(self.served_name, str) or not SERVED_NAME_PATTERN.match(self.served_name)):
            raise ValueError(f"engine.speculative.served_name must be a name clients can send as \"model\" (letters, digits "
                             f"and ._-/: up to 128 characters), or unset; got {self.served_name!r}")
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
    batch_wait_timeout_s: float = 0.01  # dynamic: how long the window waits for batch-mates
    max_num_seqs: int = 64  # sequences in one step's batch
    max_num_batched_tokens: int = 2048  # tokens in one step (decodes first, then chunks of prefills; vLLM CPU's default)
    # A step that carries decodes stays within this many ms: prefill chunks beside them are sized from the measured
    # cost per token, so a long prompt never stalls the streams for seconds; a burst waiting for first tokens that
    # outnumbers the streams, fits one step and would take over 15 such steps goes ahead of it instead, in the chunks
    # that bring its first tokens soonest on average; with nothing decoding, several short prompts waiting keep to it
    # too (their first tokens come sooner than at the end of one whole step) (0: every step takes the whole budget)
    max_decode_step_ms: float = 200.0
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_mb: int = 0  # 0: auto (CUDA: 80% of free memory after loading; CPU: min(1 GiB, 20% of RAM))
    num_kv_blocks: int = 0  # >0 overrides kv_cache_memory_mb (tests use it to force preemption)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model's: bf16 where dtype resolves to bf16) | bfloat16 | float32
    stream_interval_ms: int = 0  # under load (>1 running), send a request's tokens at most this often (0: each at once)
    max_stream_chunks_per_s: float = 0  # under load, all streams together send at most this many chunks/s (0: no cap)
    separate_process: bool = True  # run the core in its own process (no GIL shared with the server's threads)
    torch_threads: int = 0  # 0: one thread per core the process may use
    # auto: keep each of the engine's threads on its own CPU when it has one per CPU it may use (not on a GPU) | none |
    # a CPU list ("0-3,8"): thread i on the i-th, the thread count its length (docs/performance.md: Served against
    # engine alone)
    cpu_threads_bind: str = "auto"
    # Linear layers on CPU: auto (per shape and row count, the fastest as timed on this CPU at first start, cached) |
    # avx2 (ours) | avx512-bf16 (ours) | onednn | onednn-bf16 | torch (docs/performance.md: Kernel choice)
    cpu_linear_kernel: str = "auto"
    # true: one fixed-order kernel for every row count, so a token's logprob bits never depend on its batch-mates
    # (auto then never mixes kernels; the cost per CPU class is in docs/performance.md)
    batch_invariant: bool = False
    # fp32 on CPU: auto (ours where it builds, for the kinds of step it wins on this CPU, timed) | kernel (ours for
    # every step) | torch (gather + SDPA)
    cpu_attention_kernel: str = "auto"
    cpu_norm_kernel: str = "auto"  # fp32 RMSNorm on CPU: auto (ours where it builds and matches the model's) | torch
    cpu_rotary_kernel: str = "auto"  # fp32 RoPE in one-frame decoder layers: auto (ours where it gives the model's bits) | torch
    cpu_decoder_layer: str = "auto"  # packed CPU layers: auto (one-frame forward where it gives the module's bits) | torch
    # GPTQ 4-bit layers on CPU: auto (per shape and row count, as timed on this CPU) | torch (GPTQModel's layers) |
    # int4-avx512-bf16 | torch-int4 | dequant-fp32 | dequant-bf16 (one kernel for every row count; app/cpu/int4_kernels.py)
    cpu_gptq_kernel: str = "auto"
    # Requests a replica holds waiting for a place in the running batch (beyond max_num_seqs running); one more
    # gets 503 with Retry-After instead of waiting behind an ever longer queue (docs/configuration.md: Backpressure).
    max_queued_requests: int = 64
    max_queue_time_s: float = 0  # > 0: a request without its first token after this long ends with 503 (0: no deadline)
    # no step completed for this long while requests wait: the engine is wedged, the replica's health check fails
    step_timeout_s: float = 60.0
    # before ready: two prompts through the engine and through transformers' own forward must agree (else the
    # model is refused, naming what differed); false skips it (app/engine/parity.py)
    parity_check: bool = True
    # drafts verified in the next step (none by default): one drafter, or a list of them, each under its served_name
    speculative: SpecConfig | list[SpecConfig] = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"engine.batching {self.batching!r} is not one of {', '.join(BATCHING_MODES)}")
        for name in ("max_batch_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests"):
            require_int(f"engine.{name}", getattr(self, name), minimum=1)
        for name in ("kv_cache_memory_mb", "num_kv_blocks", "torch_threads", "stream_interval_ms"):
            require_int(f"engine.{name}", getattr(self, name), minimum=0)
        if isinstance(self.max_decode_step_ms, bool) or not isinstance(self.max_decode_step_ms, (int, float)) or self.max_decode_step_ms < 0:
            raise ValueError(f"engine.max_decode_step_ms must be a number of ms >= 0, got {self.max_decode_step_ms!r}")
        if not isinstance(self.max_stream_chunks_per_s, (int, float)) or self.max_stream_chunks_per_s < 0:
            raise ValueError(f"engine.max_stream_chunks_per_s must be a number >= 0, got {self.max_stream_chunks_per_s!r}")
        if isinstance(self.step_timeout_s, bool) or not isinstance(self.step_timeout_s, (int, float)) or self.step_timeout_s <= 0:
            raise ValueError(f"engine.step_timeout_s must be a number of seconds > 0, got {self.step_timeout_s!r}")
        if not isinstance(self.batch_wait_timeout_s, (int, float)) or self.batch_wait_timeout_s < 0:
            raise ValueError(f"engine.batch_wait_timeout_s must be a number >= 0, got {self.batch_wait_timeout_s!r}")
        if not isinstance(self.max_queue_time_s, (int, float)) or isinstance(self.max_queue_time_s, bool) or self.max_queue_time_s < 0:
            raise ValueError(f"engine.max_queue_time_s must be a number >= 0 (0: no deadline), got {self.max_queue_time_s!r}")
        if not isinstance(self.parity_check, bool):
            raise ValueError(f"engine.parity_check must be true or false, got {self.parity_check!r}")
        self._check_threads_bind()
        self.kv_cache_dtype = DTYPE_ALIASES.get(str(self.kv_cache_dtype).lower(), str(self.kv_cache_dtype).lower())
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"engine.kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        for name, choices in _CPU_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"engine.{name} {getattr(self, name)!r} is not one of {', '.join(choices)}")
        self.drafters = _drafters(self.speculative)
        if self.batching == "none":
            self.max_num_seqs = 1  # the naive baseline: one request at a time, whatever else is set
        if self.max_num_batched_tokens < self.max_num_seqs:  # as vLLM requires
            raise ValueError(f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least engine.max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token of each step, or the newest wait "
                             "step after step; raise the one or lower the other")

    def _check_threads_bind(self) -> None:
        if not isinstance(self.cpu_threads_bind, str):
            raise ValueError(f"engine.cpu_threads_bind must be auto, none or a CPU list such as 0-3,8, got {self.cpu_threads_bind!r}")
        self.cpu_threads_bind = self.cpu_threads_bind.strip().lower()
        try:
            cpus = listed_cpus(self.cpu_threads_bind)
        except ValueError as exc:
            raise ValueError(f"engine.cpu_threads_bind must be auto, none or a CPU list such as 0-3,8: {exc}") from None
        if cpus is not None and self.torch_threads not in (0, len(cpus)):
            raise ValueError(f"engine.cpu_threads_bind names {len(cpus)} CPUs and engine.torch_threads asks for {self.torch_threads} "
                             "threads: name one CPU per thread, or leave torch_threads at 0 (one thread per listed CPU)")


THREADS_BIND_AUTO, THREADS_BIND_NONE = "auto", "none"


def listed_cpus(setting: str) -> list[int] | None:
    """The CPUs an ``engine.cpu_threads_bind`` list names, in its order, each once (``"0-3,8"`` -> [0, 1, 2, 3, 8]);
    None for ``auto`` and ``none``."""
    if setting in (THREADS_BIND_AUTO, THREADS_BIND_NONE):
        return None
    cpus: list[int] = []
    for part in setting.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and (not last.isdigit() or int(last) < int(first))):
            raise ValueError(f"{part.strip()!r} is not a CPU number or an increasing range of them")
        cpus.extend(cpu for cpu in range(int(first), int(last or first) + 1) if cpu not in cpus)
    return cpus


def require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
