"""Load-time parity: the engine computes what transformers computes for this model, or the model is not served.

The engine runs an unmodified transformers model through its own attention function, its KV pool and, on CPU,
its kernels; an architecture whose layers do something the engine does not reproduce (a layer that keeps
the step's metadata from its attention, an attention argument it drops) would otherwise be served wrong
without a sign. So before a replica is ready, :func:`check_parity` runs two fixed prompts through the engine's
real path (the first prefilled in two chunks, the second's prefill beside it, then decode steps of both,
batched) and the same tokens through transformers' own forward (eager attention, its own cache, every module's
own forward: the fused norms, RoPE and MLP kernels set aside, the packed products checked as installed), and compares
the log-probabilities of every token the engine chose and of its 20 most likely alternatives. It also checks
that every attention layer attended through the paged path in every step, with the window the engine assumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from app.cpu import modules_own_forwards
from app.engine.paged_attention import ATTENTION_NAME
from app.engine.request import MAX_LOGPROBS, Request, SamplingParams, TokenLogprob
from app.engine.runner import configured_windows, no_longer_than
from app.engine.text_config import text_config

logger = logging.getLogger(__name__)

# Two prompts: the first longer than one step's budget (two chunks), the second prefilled beside its second chunk.
_TEXTS = ("The quick brown fox jumps over the lazy dog while five boxing wizards jump quickly over the fence.",
          "Paged attention keeps keys and values in blocks.")
_LENGTHS = (24, 11)
_CHUNK_TOKENS = 16
_NEW_TOKENS = 4

# Tolerance on a log-probability (nats). In fp32 the engine and transformers differ only in the order of their
# sums (attention over a paged pool or by our kernel; the same Linear modules): about 1e-6 relative per
# operation, 3e-5 nats measured on the embedded model. A 16-bit KV cache or 16-bit activations round each
# key, value and activation to 8 mantissa bits (2**-9 relative) where transformers' fp32 eager attention does
# not, or where its eager attention rounds in another order; quantized layers (GPTQ, bitsandbytes) compute in
# 16 bits inside, along paths that depend on how many rows a call has (a 16-token chunk here, the whole prompt
# there): 0.04 nats measured on the embedded model with a bf16 KV cache, 0.09 for its GPTQ build (AVX2 CPU).
# A path that computes something else (a dropped softcap, keys from the wrong sequence, a missing history)
# differs by whole nats (12.7 for StableLM's layers when they kept the step from their attention).
FP32_TOLERANCE = 1e-3
HALF_TOLERANCE = 0.5


class ParityError(RuntimeError):
    """The engine's path does not compute what transformers computes for this model (the message says where)."""


@dataclass
class ParityReport:
    max_gap: float  # the largest log-probability difference found (nats)
    tolerance: float
    seconds: float


def parity_tolerance(activation_dtype: torch.dtype, kv_dtype: torch.dtype, bf16_products: bool, quantized: bool) -> float:
    """The tolerance argued above for the least exact part in use."""
    exact = activation_dtype == torch.float32 and kv_dtype == torch.float32 and not bf16_products and not quantized
    return FP32_TOLERANCE if exact else HALF_TOLERANCE


def check_parity(engine, loaded) -> ParityReport:
    """Raise :class:`ParityError` unless ``engine`` (an LLMEngine over ``loaded``) matches transformers; log the gap."""
    started = time.monotonic()
    arch = architecture(loaded.model)
    requests = [Request(f"parity-check-{i}", _prompt(loaded.tokenizer, text, length, loaded.vocab_size),
                        SamplingParams(max_tokens=_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=MAX_LOGPROBS),
                        loaded.eos_token_ids)
                for i, (text, length) in enumerate(zip(_TEXTS, _LENGTHS))]
    logprobs = _run_engine(engine, requests, arch, loaded.max_model_len)
    quantized = getattr(loaded.model.config, "quantization_config", None) is not None
    tolerance = parity_tolerance(loaded.dtype, engine.runner.kv_pool.dtype, loaded.bf16_products, quantized)
    gap = 0.0
    for request in requests:
        reference = _reference_logprobs(loaded.model, request.prompt_token_ids, request.output_token_ids)  # [n, V]
        gap = max(gap, _compare(arch, request, logprobs[request.request_id], reference, tolerance))
    report = ParityReport(gap, tolerance, time.monotonic() - started)
    logger.info("parity: ok (max gap %.2g nats, tolerance %.2g; %s, %.2fs)", gap, tolerance, arch, report.seconds)
    return report


def _run_engine(engine, requests: list[Request], arch: str, max_model_len: int) -> dict[str, list[TokenLogprob]]:
    """Step ``requests`` through the engine with a small step budget (chunked prefill); check every step's layers."""
    logprobs: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in requests}
    with _step_budget(engine.scheduler, _CHUNK_TOKENS), _short_prompts_through_every_path(engine.runner):
        engine.add_requests(requests)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.error:
                    raise ParityError(f"{arch} cannot be served: {output.error}")
                logprobs[output.request_id] += output.logprobs or []
            check_attended(engine.runner, arch, max_model_len)
    return logprobs


def check_attended(runner, arch: str, max_model_len: int) -> None:
    """Raise ParityError unless the runner's last step ran every attention layer through the paged path with the window
    its config gives it: a layer that calls attention another way (no history read, or none kept), or drops its window,
    would answer silently wrong. Cheap (no reference run): made after the warm-up too, whatever
    ``engine.parity_check`` says."""
    expected = set(range(runner.kv_pool.shape[0]))
    windows = configured_windows(text_config(runner.model.config), len(expected), max_model_len)
    attended = runner.last_attended
    if set(attended) != expected:
        missing = sorted(expected - set(attended))
        raise ParityError(f"{arch} cannot be served exactly: attention layers {_span(missing)} did not take the "
                          "paged attention path (their decoder layers call attention in another way)")
    wrong = [layer for layer, window in attended.items() if no_longer_than(window, max_model_len) != windows[layer]]
    if wrong:
        layer = wrong[0]
        raise ParityError(f"{arch} cannot be served exactly: its config gives attention layer {layer} "
                          f"{_described(windows[layer])}, but the layer attended with {_described(attended[layer])} "
                          f"(layers {_span(wrong)}; its attention does not pass the window to the attention function)")


def _described(window: int | None) -> str:
    return "the whole history" if window is None else f"a {window}-token sliding window"


@contextlib.contextmanager
def _short_prompts_through_every_path(runner):
    """The check's prompts are short: let them take the path a long prompt takes (SDPA's causal kernel, where the
    route gives it prompts), so that path is checked too."""
    saved, runner.attention.prompt_min = runner.attention.prompt_min, 1
    try:
        yield
    finally:
        runner.attention.prompt_min = saved


@contextlib.contextmanager
def _step_budget(scheduler, tokens: int):
    saved = scheduler.config
    scheduler.config = dataclasses.replace(saved, max_num_batched_tokens=min(saved.max_num_batched_tokens, tokens))
    try:
        yield
    finally:
        scheduler.config = saved


@torch.inference_mode()
def _reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' own forward with its own cache, eager attention and every module's own forward (the fused ones
    set aside): log-probabilities [len(output), V] of the token after the prompt and after each output token but
    the last."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    model.set_attn_implementation("eager")
    try:
        with modules_own_forwards(model):
            cache = DynamicCache(config=model.config)
            rows = [model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True).logits[0, -1]]
            for token in output[:-1]:
                rows.append(model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache,
                                  use_cache=True).logits[0, -1])
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return torch.stack(rows).float().log_softmax(dim=-1)


def _compare(arch: str, request: Request, logprobs: list[TokenLogprob], reference: torch.Tensor, tolerance: float) -> float:
    """The largest gap over each chosen token and its alternatives; raise where it passes ``tolerance`` or where
    the engine's greedy choice is not transformers' top token (up to the tolerance)."""
    worst = 0.0
    for step, lp in enumerate(logprobs):
        row = reference[step]
        for token, value in [(lp.token_id, lp.logprob), *lp.top]:
            gap = abs(value - float(row[token]))
            worst = max(worst, gap)
            if not gap <= tolerance:  # (a NaN fails too)
                raise ParityError(
                    f"{arch} cannot be served exactly: at generated token {step} of a {len(request.prompt_token_ids)}-token "
                    f"prompt, the engine's log-probability of token {token} is {value:.4f} where transformers computes "
                    f"{float(row[token]):.4f} (gap {gap:.3g} > tolerance {tolerance:.3g})")
        if float(row[lp.token_id]) < float(row.max()) - tolerance:
            raise ParityError(f"{arch} cannot be served exactly: at generated token {step} the engine chose token "
                              f"{lp.token_id}, which transformers ranks {float(row.max() - row[lp.token_id]):.3g} nats "
                              "below its top token")
    return worst


def _prompt(tokenizer, text: str, length: int, vocab: int) -> list[int]:
    """``length`` tokens of ``text`` (repeated as needed), within the model's vocabulary."""
    ids = [t for t in tokenizer.encode(text, add_special_tokens=False) if 0 <= t < vocab] or list(range(1, 17))
    return (ids * (length // len(ids) + 1))[:length]


def architecture(model) -> str:
    architectures = getattr(model.config, "architectures", None)
    return architectures[0] if architectures else type(model).__name__


def _span(indices: list[int]) -> str:
    return ", ".join(map(str, indices[:8])) + (f" (and {len(indices) - 8} more)" if len(indices) > 8 else "")
