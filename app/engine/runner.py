"""The model runner: owns the KV pool, turns a SchedulerOutput into one forward pass, samples.

This is the only part of the engine that touches tensors. One step is one call of the unmodified
transformers model on a packed ``[1, T]`` row of every scheduled token, with position ids per
token and paged attention (``app.engine.paged_attention``) reading and writing the KV pool. On CPU
the fast path (``app/cpu``) puts our kernels under the model where they give the module's results.
Logits are computed only at the last token of the requests that sample this step.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import psutil
import torch

from app.config import EngineConfig
from app.cpu import install_fast_path
from app.engine.attention_choice import attention_route
from app.engine.grammar import Grammars
from app.engine.host_memory import advise_huge_pages, tensor_spans
from app.models.exact_context import packed_step_limit
from app.engine.kv_cache import BlockManager
from app.engine.paged_attention import SequenceSlice, register_paged_attention
from app.engine.request import Request, TokenLogprob
from app.engine.sampling import NoTokenLeftError, Sampler, has_penalty, token_logprobs
from app.engine.scheduler import ScheduledRequest, SchedulerOutput
from app.engine.text_config import text_config
from app.models import LoadedModel
from app.models.attention_layers import UnsupportedArchitectureError, architecture_name, require_attention_decoder
from app.spec.verify import verify_drafts

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
_CUDA_FREE_FRACTION = 0.8


@dataclass
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_config) -> "KVCacheShape":
        require_attention_decoder(model_config)
        heads = model_config.num_attention_heads
        try:
            head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        except Exception as exc:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (Gemma 4)
            raise UnsupportedArchitectureError(f"{architecture_name(model_config)} cannot be served: its attention layers have head sizes of their own "
                                               "(head_dim varies by layer), where the paged KV pool holds one size") from exc
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return cls(model_config.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class RunnerOutput:
    """The requests that sampled this step and, in the same order, the tokens each one emits.

    One token per request, or for a request with drafts: the drafts the target accepted (lossless rejection
    sampling; greedy: those its argmax agrees with), then one token from the target, at the first rejection
    or after the last draft.
    """

    requests: list[Request] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob | None]] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)  # drafts verified this step, per request
    num_accepted: list[int] = field(default_factory=list)  # of which the target kept
    errors: list[str | None] = field(default_factory=list)  # why a request failed this step alone (no tokens)


def uniform_sliding_window(model_config) -> int | None:
    """The window every attention layer of the model slides by (Mistral, Qwen2 with every layer sliding), or None
    where some layer attends the whole history (Gemma 2/3's global layers) or none slides. The layers' own
    arguments decide what each attends; this only lets the engine hand back blocks no layer will read again
    (and the load-time parity check confirms that every layer attended with its configured window)."""
    windows = set(configured_windows(model_config, len(getattr(model_config, "layer_types", None) or [None])))
    return windows.pop() if len(windows) == 1 else None


def configured_windows(model_config, num_layers: int, max_model_len: int | None = None) -> list[int | None]:
    """Each layer's sliding window as the config states it (``sliding_window`` for every layer, or for the layers
    ``layer_types`` calls sliding); None: the whole history. A window at least as long as the context is none."""
    window = getattr(model_config, "sliding_window", None)
    if not window or getattr(model_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    kinds = list(getattr(model_config, "layer_types", None) or ["sliding_attention"] * num_layers)
    kinds += ["full_attention"] * (num_layers - len(kinds))
    return [no_longer_than(int(window), max_model_len) if kind == "sliding_attention" else None for kind in kinds[:num_layers]]


def no_longer_than(window: int | None, max_model_len: int | None) -> int | None:
    """A window, or None where it covers the whole context anyway."""
    return None if window is None or (max_model_len is not None and window >= max_model_len) else window


def _require_steps_within_the_packed_limit(model_config, max_num_batched_tokens: int) -> None:
    """Refuse a step budget past what the architecture computes exactly in one packed pass (app/models/exact_context.py)."""
    limit = packed_step_limit(model_config)
    if limit is not None and max_num_batched_tokens > limit[0]:
        raise ValueError(f"engine.max_num_batched_tokens {max_num_batched_tokens} is past the {limit[0]} tokens one step "
                         f"of this model may pack: {limit[1]}; set it to at most {limit[0]}")


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        model_config = text_config(loaded.model.config)  # a multimodal checkpoint's decoder
        _require_steps_within_the_packed_limit(model_config, config.max_num_batched_tokens)
        self.sliding_window = uniform_sliding_window(model_config)
        self.device = loaded.device
        self.block_size = config.block_size
        shape = KVCacheShape.of(model_config)
        kv_dtype = kv_cache_dtype(config, loaded)
        self.num_blocks = config.num_kv_blocks or _blocks_for_budget(shape, kv_dtype, config, self.device)
        # [layers, key/value, slots, kv_heads, head_dim]: allocated once, never grown, so a step cannot OOM. One slot
        # past the blocks stays zero: the padding a batched attention reads for a key outside its sequence (paged_batch.py)
        self.kv_pool = torch.empty(
            shape.num_layers, 2, self.num_blocks * self.block_size + 1, shape.num_kv_heads, shape.head_dim,
            dtype=kv_dtype, device=self.device,
        )
        advise_huge_pages(tensor_spans([self.kv_pool]))  # before its first write: its pages then come 2 MB at a time
        self.kv_pool.zero_()
        self.kv_bytes = self.kv_pool.numel() * self.kv_pool.element_size()
        self.sampler = Sampler(Grammars(loaded.tokenizer, model_config.vocab_size, loaded.eos_token_ids))
        self.step = register_paged_attention(self.model)
        self.last_attended: dict[int, int | None] = {}  # the last step's attention layers (index -> window)
        # plain fp32 CPU Linear layers only (quantized ones run as loaded); bf16 weights where the loader chose them
        self.fast_path = install_fast_path(self.model, config, loaded.dtype, kv_dtype, loaded.weight_dtype, loaded.bf16_products)
        self.attention = attention_route(self.fast_path.attention, config, model_config.num_attention_heads,
                                         shape.num_kv_heads, shape.head_dim, kv_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%.0f MB)", self.num_blocks, self.block_size, self.kv_bytes / 2**20)

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    def execute(self, output: SchedulerOutput, blocks: BlockManager) -> RunnerOutput:
        token_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        prompt_rows: list[int] = []  # rows whose logits give prompt tokens' logprobs (sampling.prompt_logprobs)
        prompt_requests: list[tuple[Request, range]] = []
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            slices.append(SequenceSlice(len(token_ids), item.num_new_tokens, start, blocks.block_table(request.request_id)))
            if (wanted := _prompt_logprob_positions(request, start, end)):
                prompt_rows.extend(len(token_ids) + p - start for p in wanted)
                prompt_requests.append((request, wanted))
            token_ids.extend(_token_range(request, start, end - item.num_spec_tokens))
            token_ids.extend(request.spec_token_ids[: item.num_spec_tokens])
            positions.extend(range(start, end))
            if item.samples:  # the last token, and each draft after it, predicts the next one
                sample_rows.extend(range(len(token_ids) - 1 - item.num_spec_tokens, len(token_ids)))
                sampling.append(item)
        batch = self.attention.batch(self.kv_pool, self.block_size, slices)
        self.step.batch = batch
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=torch.tensor([token_ids], device=self.device),  # [1, T]
                    position_ids=torch.tensor([positions], device=self.device),  # [1, T]
                    use_cache=False,
                    logits_to_keep=torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=self.device),
                )
        finally:
            self.step.batch = None
            self.last_attended = batch.attended
        with torch.inference_mode():
            if prompt_requests:
                _record_prompt_logprobs(out.logits[0, len(sample_rows) :], prompt_requests)
            return self._sample(out.logits[0, : len(sample_rows)], sampling)  # [S, V], one row per sampled position

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> RunnerOutput:
        """logits: [S, V], ``1 + num_spec_tokens`` rows per item. One token per plain request; a drafting
        request's verified drafts and the token after them (app/spec/verify.py)."""
        first_row = list(itertools.accumulate((1 + item.num_spec_tokens for item in items), initial=0))
        plain = [i for i, item in enumerate(items) if not item.num_spec_tokens]
        drafting = [i for i, item in enumerate(items) if item.num_spec_tokens]
        emitted: list[list[int]] = [[] for _ in items]
        logprobs: list[list[TokenLogprob | None] | None] = [None] * len(items)  # None: computed in _output
        accepted = [0] * len(items)
        errors: list[str | None] = [None] * len(items)
        if plain:  # the steady state without drafts samples the logits as they are (the sampler keeps raw rows)
            rows = logits if not drafting else logits[torch.tensor([first_row[i] for i in plain], device=logits.device)]
            for i, sampled in zip(plain, _isolated(self._sample_plain, rows, [items[i] for i in plain], self.sampler)):
                if isinstance(sampled, str):
                    errors[i] = sampled
                else:
                    emitted[i], logprobs[i] = [sampled[0]], [sampled[1]]
        if drafting:
            rows = torch.cat([torch.arange(first_row[i], first_row[i + 1]) for i in drafting]).to(logits.device)
            for i, verified in zip(drafting, _isolated(self._verify, logits[rows], [items[i] for i in drafting], self.sampler)):  # a copy
                if isinstance(verified, str):
                    errors[i] = verified
                else:
                    emitted[i], accepted[i] = verified
        return self._output(logits, items, first_row, emitted, logprobs, accepted, errors)

    def _sample_plain(self, rows: torch.Tensor, items: list[ScheduledRequest]) -> list[tuple[int, TokenLogprob | None]]:
        """rows: [n, V], one per item -> (token, its logprob) per item."""
        tokens, token_lps = self.sampler.sample_with_logprobs(rows, [item.request for item in items])
        return list(zip(tokens, token_lps))

    def _verify(self, rows: torch.Tensor, items: list[ScheduledRequest]) -> list[tuple[list[int], int]]:
        """rows: [sum(1 + k), V] -> (emitted tokens, drafts kept) per item (app/spec/verify.py)."""
        requests = [item.request for item in items]
        drafts = [r.spec_token_ids[: item.num_spec_tokens] for item, r in zip(items, requests)]
        draft_probs = [r.spec_draft_probs[: item.num_spec_tokens] if r.spec_draft_probs is not None else None
                       for item, r in zip(items, requests)]
        generators = [self._generator(r) for r in requests]
        if any(has_penalty(r) for r in requests):  # penalized in place: rows verified again alone stay raw
            rows = rows.clone()
        if self.sampler.grammars is not None and any(r.matcher is not None for r in requests):
            rows = rows.float().contiguous()
            self.sampler.grammars.mask_drafts(rows, requests, drafts)  # structured outputs: each position's grammar
        tokens, kept = verify_drafts(rows, requests, drafts, generators, draft_probs)
        return list(zip(tokens, kept))

    def _output(self, logits, items, first_row, emitted, token_lps, accepted, errors) -> RunnerOutput:
        """The runner's answer; a drafting request's logprobs from the raw logits of its emitted rows (if asked)."""
        result = RunnerOutput()
        for i, item in enumerate(items):
            request, tokens, logprobs = item.request, emitted[i], token_lps[i]
            if logprobs is None and request.sampling.logprobs is not None and errors[i] is None:
                raw = logits[first_row[i] : first_row[i] + len(tokens)].float()  # [n, V]
                logprobs = token_logprobs(raw, tokens, [request] * len(tokens))
            elif logprobs is None:
                logprobs = [None] * len(tokens)
            result.requests.append(request)
            result.token_ids.append(tokens)
            result.logprobs.append(logprobs)
            result.num_drafted.append(item.num_spec_tokens)
            result.num_accepted.append(accepted[i])
            result.errors.append(errors[i])
        return result

    def _generator(self, request: Request) -> torch.Generator | None:
        seeded = request.sampling.seed is not None and not request.sampling.greedy
        return self.sampler.generator_for(request, self.device) if seeded else None

    def admit(self, request: Request) -> None:
        """Per-request sampling state, made as the request is admitted (a failure here is the request's alone)."""
        self.sampler.admit(request, self.device)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)


def _isolated(batched, rows: torch.Tensor, items: list[ScheduledRequest], sampler: Sampler) -> list:
    """``batched(rows, items)``: one result per item, from one batched call. If that call raises, each item's
    rows again alone: the item that raises gets its error text instead of a result, and the others the result
    they had in the batch (sampling is per row, and a seeded row draws from its own generator, put back as it was
    before the failed call: draws made for rows verified before the failing one are drawn again alike). One
    request's bad parameters or a bug its input reaches never fail its batch-mates."""
    states = sampler.generator_states([item.request for item in items])
    try:
        return batched(rows, items)
    except Exception:  # noqa: BLE001 - re-run below, item by item
        logger.warning("sampling a batch of %d failed; sampling its requests one at a time", len(items))
    sampler.restore_generator_states(states)
    results, start = [], 0
    for item in items:
        count = 1 + item.num_spec_tokens
        try:
            results.extend(batched(rows[start : start + count], [item]))
        except NoTokenLeftError as exc:  # the request's own bans: no fault of ours, no traceback
            logger.warning("request %s failed while sampling: %s", item.request.request_id, exc)
            results.append(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - this request's failure, reported to it alone
            logger.exception("request %s failed while sampling", item.request.request_id)
            results.append(f"{type(exc).__name__}: {exc}")
        start += count
    return results


def _prompt_logprob_positions(request: Request, start: int, end: int) -> range:
    """Positions of this step whose logits give a prompt token's logprob not yet recorded (position p: token p + 1)."""
    if request.sampling.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(request.prompt_logprobs) - 1), min(end, request.num_prompt_tokens - 1))


def _record_prompt_logprobs(logits: torch.Tensor, wanted: list[tuple[Request, range]]) -> None:
    """logits: [R, V], the rows of ``wanted``'s positions in order: each prompt token's logprob under the model's raw
    distribution, with the request's number of most likely alternatives, appended to ``request.prompt_logprobs``."""
    logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
    row = 0
    for request, positions in wanted:
        targets = torch.tensor(request.prompt_token_ids[positions.start + 1 : positions.stop + 1], device=logits.device)
        rows = logprobs[row : row + len(positions)]  # [n, V]
        chosen = rows.gather(1, targets.unsqueeze(1))  # [n, 1]
        ranks = ((rows > chosen).sum(dim=-1) + 1).tolist()
        count = request.sampling.prompt_logprobs
        top_values, top_ids = rows.topk(count, dim=-1) if count else (rows[:, :0], rows[:, :0].long())
        for token, value, rank, ids, values in zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids.tolist(),
                                                   top_values.tolist()):
            request.prompt_logprobs.append(TokenLogprob(token, value, list(zip(ids, values)), rank=rank))
        row += len(positions)


def _token_range(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without concatenating the whole history every step."""
    prompt = request.prompt_token_ids
    if start >= len(prompt):
        return request.output_token_ids[start - len(prompt) : end - len(prompt)]
    return (prompt + request.output_token_ids[: max(0, end - len(prompt))])[start:end]


def kv_cache_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The KV pool's dtype: ``auto`` is the dtype the model computes in, which on the bf16-product path (fp32
    activations, bf16 products) is bf16, as vLLM's ``kv_cache_dtype: auto`` is for a bf16 model: half the
    bytes a decode step reads. ``float32`` keeps fp32 keys and values under a bf16 model's products."""
    if config.kv_cache_dtype != "auto":
        return getattr(torch, config.kv_cache_dtype)
    return torch.bfloat16 if loaded.bf16_products else loaded.dtype


def _blocks_for_budget(shape: KVCacheShape, dtype: torch.dtype, config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_mb:
        budget = config.kv_cache_memory_mb * 2**20
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_FREE_FRACTION)
    else:
        budget = min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 5)
    return max(1, budget // (shape.bytes_per_token(dtype) * config.block_size))
