"""Paged attention against plain causal attention, without a model: prefill chunks, decodes, mixed steps."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from app.engine.paged_attention import PagedBatch, SequenceSlice, paged_attention_forward

KV_HEADS, REPEAT, HEAD_DIM, BLOCK = 2, 3, 8, 4
HEADS = KV_HEADS * REPEAT
TABLES = {"a": [3, 7, 0], "b": [1, 6], "c": [5, 2, 4]}  # scattered blocks, as a pool in use has them


class Sequences:
    """Runs steps through paged attention and keeps each sequence's whole K/V for the reference."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.pool = torch.zeros(1, 2, 8 * BLOCK, KV_HEADS, HEAD_DIM)  # [layers, k/v, slots, Hkv, D]
        self.keys = {name: torch.empty(KV_HEADS, 0, HEAD_DIM) for name in TABLES}
        self.values = {name: torch.empty(KV_HEADS, 0, HEAD_DIM) for name in TABLES}

    def step(self, new_tokens: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """One packed step; returns paged output, reference output (both [T, H, D]) and the batch."""
        total = sum(new_tokens.values())
        query = torch.randn(1, HEADS, total, HEAD_DIM)
        key, value = torch.randn(1, KV_HEADS, total, HEAD_DIM), torch.randn(1, KV_HEADS, total, HEAD_DIM)
        slices, expected, start = [], [], 0
        for name, n in new_tokens.items():
            computed = self.keys[name].shape[1]
            slices.append(SequenceSlice(start, n, computed, TABLES[name]))
            self.keys[name] = torch.cat([self.keys[name], key[0, :, start : start + n]], dim=1)
            self.values[name] = torch.cat([self.values[name], value[0, :, start : start + n]], dim=1)
            expected.append(_reference(query[0, :, start : start + n], self.keys[name], self.values[name], computed))
            start += n
        batch = PagedBatch.build(self.pool, BLOCK, slices)
        out, _ = paged_attention_forward(SimpleNamespace(layer_idx=0), query, key, value, None, paged_batch=batch)
        assert out.shape == (1, total, HEADS, HEAD_DIM)
        return out[0], torch.cat(expected), batch


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, computed: int) -> torch.Tensor:
    """Causal attention of one sequence's new queries [H, n, D] over its keys [Hkv, L, D]: [n, H, D]."""
    keys, values = keys.repeat_interleave(REPEAT, dim=0), values.repeat_interleave(REPEAT, dim=0)
    n, length = query.shape[1], keys.shape[1]
    mask = torch.arange(length).view(1, -1) <= (computed + torch.arange(n)).view(-1, 1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize(
    "steps",
    [
        [{"a": 6, "b": 3}, {"a": 1, "b": 1}, {"b": 1, "a": 1}],  # prefill, then decode-only steps
        [{"a": 5}, {"a": 1, "c": 4}, {"c": 3, "a": 1, "b": 2}, {"a": 1, "b": 1, "c": 1}],  # chunked + mixed
    ],
)
def test_paged_attention_equals_causal_attention_over_each_sequence(steps):
    sequences = Sequences()
    for new_tokens in steps:
        got, expected, batch = sequences.step(new_tokens)
        assert batch.decode_only == all(n == 1 for n in new_tokens.values())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
