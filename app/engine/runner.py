"""The model runner: owns the KV pool, turns a SchedulerOutput into one forward pass, samples.

This is the only part of the engine that touches tensors. One step is one call of the unmodified
transformers model on a packed ``[1, T]`` row of every scheduled token, with position ids per
token and paged attention (``app.engine.paged_attention``) reading and writing the KV pool. On CPU
the fast path (``app/cpu``) puts our kernels under the model where they give the module's results.
Logits are computed only at the last token of the requests that sample this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from app.config import EngineConfig
from app.cpu import install_fast_path
from app.engine.kv_cache import BlockManager
from app.engine.paged_attention import PagedBatch, SequenceSlice, register_paged_attention
from app.engine.request import Request, TokenLogprob
from app.engine.sampling import Sampler
from app.engine.scheduler import SchedulerOutput
from app.models import LoadedModel

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
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return cls(model_config.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class RunnerOutput:
    """The requests that sampled this step, and the token each one sampled (same order)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def check_attention_supported(model_config, max_model_len: int) -> None:
    """Paged attention here is full causal attention; refuse models whose layers attend differently."""
    window = getattr(model_config, "sliding_window", None)
    if window and getattr(model_config, "use_sliding_window", True) and max_model_len > window:
        raise ValueError(
            f"the model uses sliding-window attention ({window} tokens), which the paged engine does not "
            f"implement yet; set model.max_model_len to at most {window} to serve it exactly"
        )


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        check_attention_supported(loaded.model.config, loaded.max_model_len)
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = config.block_size
        shape = KVCacheShape.of(self.model.config)
        self.num_blocks = config.num_kv_blocks or _blocks_for_budget(shape, loaded.dtype, config, self.device)
        # [layers, key/value, slots, kv_heads, head_dim]: allocated once, never grown, so a step cannot OOM.
        self.kv_pool = torch.zeros(
            shape.num_layers, 2, self.num_blocks * self.block_size, shape.num_kv_heads, shape.head_dim,
            dtype=loaded.dtype, device=self.device,
        )
        self.kv_bytes = self.kv_pool.numel() * self.kv_pool.element_size()
        self.sampler = Sampler()
        register_paged_attention(self.model)
        # plain fp32 CPU Linear layers only (quantized ones run as loaded); bf16 weights where the loader chose them
        self.fast_path = install_fast_path(self.model, config, self.kv_pool.dtype, loaded.weight_dtype)
        logger.info("KV cache: %d blocks of %d tokens (%.0f MB)", self.num_blocks, self.block_size, self.kv_bytes / 2**20)

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    def execute(self, output: SchedulerOutput, blocks: BlockManager) -> RunnerOutput:
        token_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            slices.append(SequenceSlice(len(token_ids), item.num_new_tokens, start, blocks.block_table(request.request_id)))
            token_ids.extend(_token_range(request, start, end))
            positions.extend(range(start, end))
            if item.samples:
                sample_rows.append(len(token_ids) - 1)
                sampling.append(request)
        batch = PagedBatch.build(self.kv_pool, self.block_size, slices, self.fast_path.attention)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([token_ids], device=self.device),  # [1, T]
                position_ids=torch.tensor([positions], device=self.device),  # [1, T]
                use_cache=False,
                logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
                paged_batch=batch,
            )
            sampled, logprobs = self.sampler.sample_with_logprobs(out.logits[0], sampling) if sampling else ([], [])
        return RunnerOutput(sampling, sampled, logprobs)  # logits above: [S, V]

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)


def _token_range(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without concatenating the whole history every step."""
    prompt = request.prompt_token_ids
    if start >= len(prompt):
        return request.output_token_ids[start - len(prompt) : end - len(prompt)]
    return (prompt + request.output_token_ids[: max(0, end - len(prompt))])[start:end]


def _blocks_for_budget(shape: KVCacheShape, dtype: torch.dtype, config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_mb:
        budget = config.kv_cache_memory_mb * 2**20
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_FREE_FRACTION)
    else:
        budget = min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 5)
    return max(1, budget // (shape.bytes_per_token(dtype) * config.block_size))
