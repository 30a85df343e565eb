"""Paged attention against plain causal attention, without a model: prefill chunks, decodes, mixed steps; over
fp32 pools and bf16 ones (keys and values rounded to bf16 as stored, queries and outputs fp32)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from app.cpu import build
from app.cpu.attention import PagedAttentionKernel
from tests.unit.cpu.conftest import loaded_ops, needs_kernels as needs_kernel
from app.engine.paged_attention import PagedBatch, SequenceSlice, paged_attention_forward

KV_HEADS, REPEAT, HEAD_DIM, BLOCK = 2, 3, 8, 4
HEADS = KV_HEADS * REPEAT
TABLES = {"a": [3, 7, 0], "b": [1, 6], "c": [5, 2, 4]}  # scattered blocks, as a pool in use has them
KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])


def _stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """What a pool of ``kv_dtype`` gives back for fp32 keys or values ``x``."""
    return x.to(kv_dtype).float()


class Sequences:
    """Runs steps through paged attention and keeps each sequence's whole K/V for the reference; ``window`` and
    ``softcap`` are the layer's attention arguments (a sliding window, logit softcapping)."""

    def __init__(self, decode_kernel=None, kv_dtype: torch.dtype = torch.float32, window: int | None = None,
                 softcap: float | None = None) -> None:
        torch.manual_seed(0)
        self.decode_kernel, self.kv_dtype, self.window, self.softcap = decode_kernel, kv_dtype, window, softcap
        self.sdpa_prompts, self.sdpa_prompt_min = False, 1  # prompts through SDPA's causal kernel (PagedBatch.build)
        self.tables = {name: list(table) for name, table in TABLES.items()}
        # [layers, k/v, slots, Hkv, D]: 8 blocks and, as the runner lays it out, one zero slot past them
        self.pool = torch.zeros(1, 2, 8 * BLOCK + 1, KV_HEADS, HEAD_DIM, dtype=kv_dtype)
        self.keys = {name: torch.empty(KV_HEADS, 0, HEAD_DIM) for name in TABLES}
        self.values = {name: torch.empty(KV_HEADS, 0, HEAD_DIM) for name in TABLES}

    def hand_back_blocks_before_windows(self) -> None:
        """As the block manager does where every layer slides: blocks wholly before the next query's window go back
        to the pool (their table entries -1); here they are also filled with NaN, which must never be read."""
        for name, table in self.tables.items():
            first_needed = self.keys[name].shape[1] - self.window + 1
            for index in range(max(0, first_needed) // BLOCK):
                if table[index] >= 0:
                    self.pool[:, :, table[index] * BLOCK : (table[index] + 1) * BLOCK] = float("nan")
                    table[index] = -1

    def step(self, new_tokens: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """One packed step; returns paged output, reference output (both [T, H, D]) and the batch."""
        total = sum(new_tokens.values())
        query = torch.randn(1, HEADS, total, HEAD_DIM)
        key, value = torch.randn(1, KV_HEADS, total, HEAD_DIM), torch.randn(1, KV_HEADS, total, HEAD_DIM)
        slices, expected, start = [], [], 0
        for name, n in new_tokens.items():
            computed = self.keys[name].shape[1]
            slices.append(SequenceSlice(start, n, computed, self.tables[name]))
            self.keys[name] = torch.cat([self.keys[name], _stored(key[0, :, start : start + n], self.kv_dtype)], dim=1)
            self.values[name] = torch.cat([self.values[name], _stored(value[0, :, start : start + n], self.kv_dtype)], dim=1)
            expected.append(_reference(query[0, :, start : start + n], self.keys[name], self.values[name], computed,
                                       self.window, self.softcap))
            start += n
        batch = PagedBatch.build(self.pool, BLOCK, slices, self.decode_kernel, self.sdpa_prompts, self.sdpa_prompt_min)
        out, _ = paged_attention_forward(SimpleNamespace(layer_idx=0), query, key, value, None, paged_batch=batch,
                                         sliding_window=self.window, softcap=self.softcap, position_ids=None)
        assert out.shape == (1, total, HEADS, HEAD_DIM)
        return out[0], torch.cat(expected), batch


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, computed: int,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new queries [H, n, D] over its keys [Hkv, L, D]: [n, H, D]; with a
    window, each query sees its last ``window`` keys (itself included), as transformers' sliding mask."""
    keys, values = keys.repeat_interleave(REPEAT, dim=0), values.repeat_interleave(REPEAT, dim=0)
    n, length = query.shape[1], keys.shape[1]
    positions = (computed + torch.arange(n)).view(-1, 1)
    mask = torch.arange(length).view(1, -1) <= positions
    if window is not None:
        mask &= torch.arange(length).view(1, -1) > positions - window
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).transpose(0, 1)
    scores = torch.tanh(query @ keys.transpose(1, 2) * HEAD_DIM**-0.5 / softcap) * softcap  # [H, n, L]
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).transpose(0, 1)


@pytest.mark.parametrize(
    "steps",
    [
        [{"a": 6, "b": 3}, {"a": 1, "b": 1}, {"b": 1, "a": 1}],  # prefill, then decode-only steps
        [{"a": 5}, {"a": 1, "c": 4}, {"c": 3, "a": 1, "b": 2}, {"a": 1, "b": 1, "c": 1}],  # chunked + mixed
    ],
)
@KV_DTYPES
def test_paged_attention_equals_causal_attention_over_each_sequence(steps, kv_dtype):
    sequences = Sequences(kv_dtype=kv_dtype)
    for new_tokens in steps:
        got, expected, batch = sequences.step(new_tokens)
        assert batch.decode_only == all(n == 1 for n in new_tokens.values())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("route", ["torch", "kernel"])
def test_no_slot_outside_a_sequence_reaches_its_output_even_inf(route):
    """A padded batch (the torch route) reads slots past each row's keys, masked: a masked inf or NaN there (a stale
    slot, a batch-mate's or a freed block's overflow) would still make the row NaN (0 * inf), failing a request for
    another's numbers. Every slot no sequence wrote holds inf here; the pool's last slot is the runner's zero one."""
    if route == "kernel" and build.unsupported_reason() is not None:
        pytest.skip(f"the CPU kernels cannot run here: {build.unsupported_reason()}")
    sequences = Sequences(load_decode_attention() if route == "kernel" else None)
    sequences.pool.fill_(float("inf"))
    sequences.pool[:, :, -1] = 0
    for new_tokens in ({"a": 9, "b": 2, "c": 5}, {"a": 1, "b": 1, "c": 1}, {"b": 1, "a": 1}, {"c": 3, "b": 1}):
        got, expected, _ = sequences.step(new_tokens)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


WINDOW_STEPS = [{"a": 7, "c": 3}, {"a": 1, "c": 6}, {"a": 1, "c": 1}, {"b": 5, "a": 1, "c": 1}, {"a": 1, "b": 1}]


@pytest.mark.parametrize("route", ["torch", "kernel"])
@pytest.mark.parametrize("window, softcap", [(5, None), (None, 0.7), (6, 0.7)])
@KV_DTYPES
def test_sliding_windows_and_softcapping_equal_the_reference(route, window, softcap, kv_dtype):
    """Windows shorter than the sequences, crossing prefill chunks and blocks; blocks wholly before every window
    handed back (NaN in the pool) without a change; softcapped layers take the torch route on a kernel step too."""
    if route == "kernel" and build.unsupported_reason() is not None:
        pytest.skip(f"the CPU kernels cannot run here: {build.unsupported_reason()}")
    sequences = Sequences(load_decode_attention() if route == "kernel" else None, kv_dtype, window, softcap)
    for new_tokens in WINDOW_STEPS:
        got, expected, batch = sequences.step(new_tokens)
        assert batch.attended == {0: window}
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if window is not None:
            sequences.hand_back_blocks_before_windows()
    if window is not None:
        assert -1 in sequences.tables["a"]  # the last steps ran with handed-back blocks


def test_attention_arguments_the_engine_cannot_honour_are_refused_by_name():
    from app.engine.paged_attention import UnsupportedAttentionError, attention_options

    assert attention_options({"sliding_window": 8, "softcap": 30.0, "position_ids": None, "is_causal": True}).window == 8
    for kwargs, named in [({"s_aux": torch.zeros(2)}, "attention sinks"), ({"is_causal": False}, "non-causal"),
                          ({"position_bias": torch.zeros(1)}, "position_bias"), ({"sliding_window": 0}, "sliding window")]:
        with pytest.raises(UnsupportedAttentionError, match=named):
            attention_options(dict(kwargs))


def load_decode_attention() -> PagedAttentionKernel:
    loaded_ops()  # this machine supports the kernels: a failed build fails the test
    return PagedAttentionKernel()


@needs_kernel
@KV_DTYPES
def test_decode_steps_through_our_cpu_kernel_equal_causal_attention(kv_dtype):
    kernel = load_decode_attention()
    assert kernel is not None
    sequences = Sequences(kernel, kv_dtype)
    for new_tokens in [{"a": 6, "b": 3, "c": 9}, {"a": 1, "b": 1, "c": 1}, {"c": 1, "a": 1}, {"a": 1, "b": 2}]:
        got, expected, batch = sequences.step(new_tokens)
        decode_only = all(n == 1 for n in new_tokens.values())
        assert batch.kernel is kernel and (batch.kernel_decode is not None) == decode_only
        assert (batch.kernel_queries is not None) == (not decode_only)  # prefill and mixed steps: the same kernel
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _attend_in_steps(kernel, tokens: dict[str, tuple], steps: list[dict[str, int]], heads: int, kv_heads: int,
                     kv_dtype: torch.dtype) -> dict:
    """Run each sequence's tokens (query [N, H, D], key and value [N, Hkv, D]) through the kernel paths in the
    given steps (tokens per sequence per step); returns each sequence's attention outputs [N, H, D]."""
    head_dim = next(iter(tokens.values()))[0].shape[-1]
    blocks = {name: list(range(i, 64, len(tokens)))[::-1] for i, name in enumerate(tokens)}  # interleaved, reversed
    pool = torch.zeros(1, 2, 64 * BLOCK, kv_heads, head_dim, dtype=kv_dtype)
    done, outputs = dict.fromkeys(tokens, 0), {name: [] for name in tokens}
    for step in steps:
        slices, parts, start = [], [], 0
        for name, n in step.items():
            slices.append(SequenceSlice(start, n, done[name], blocks[name]))
            parts.append([t[done[name] : done[name] + n] for t in tokens[name]])
            start += n
        query, key, value = (torch.cat([p[i] for p in parts]).transpose(0, 1).unsqueeze(0) for i in range(3))
        batch = PagedBatch.build(pool, BLOCK, slices, kernel)
        out, _ = paged_attention_forward(SimpleNamespace(layer_idx=0), query, key, value, None, paged_batch=batch)
        for piece, (name, n) in zip(out[0].split(list(step.values())), step.items()):
            outputs[name].append(piece)
            done[name] += n
    return {name: torch.cat(parts) for name, parts in outputs.items()}


@needs_kernel
@KV_DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 12), (8, 1, 40), (16, 4, 64)])
def test_a_token_gets_the_same_bits_however_its_sequence_is_cut_into_steps(heads, kv_heads, head_dim, kv_dtype):
    """Whole prefill, chunks beside another sequence, prefill then decodes: every output bit for bit the same
    (what makes prefix-cache hits, chunked prefill, batch-mates and preemption leave logprobs unchanged)."""
    kernel = load_decode_attention()
    torch.manual_seed(heads * head_dim)
    n = 37
    tokens = {name: (torch.randn(n, heads, head_dim), torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim))
              for name in ("x", "other")}
    whole = _attend_in_steps(kernel, {"x": tokens["x"]}, [{"x": n}], heads, kv_heads, kv_dtype)["x"]
    chunked = _attend_in_steps(kernel, tokens, [{"other": 9, "x": 5}, {"x": 6, "other": 1}, {"x": 13}, {"other": 20, "x": 13},
                                                {"other": 7}], heads, kv_heads, kv_dtype)
    decoded = _attend_in_steps(kernel, tokens, [{"x": 3, "other": 30}, *[{"other": 1, "x": 1}] * 7, *[{"x": 1}] * 27],
                               heads, kv_heads, kv_dtype)
    assert torch.equal(chunked["x"], whole) and torch.equal(decoded["x"], whole)
    assert torch.equal(chunked["other"], decoded["other"])
    q, k, v = tokens["x"]  # and it is causal attention over the keys and values as stored
    k, v = _stored(k, kv_dtype), _stored(v, kv_dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
                                              v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0), attn_mask=mask)
    torch.testing.assert_close(whole, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


def _kernel_case(seqs: int, heads: int, kv_heads: int, head_dim: int, key_counts: list[int],
                 kv_dtype: torch.dtype = torch.float32) -> dict:
    """A decode step's kernel arguments: each sequence's last key slot is where its new key and value go."""
    torch.manual_seed(seqs + head_dim)
    slots = 4 * sum(key_counts)
    k_pool, v_pool = (torch.randn(slots, kv_heads, head_dim).to(kv_dtype) for _ in range(2))
    width = max(key_counts)
    key_slots = torch.zeros(seqs, width, dtype=torch.long)
    for b, n in enumerate(key_counts):
        key_slots[b, :n] = torch.randperm(slots)[:n]  # keys anywhere in the pool, in any order
    # [1, H, B, D] views of one projection's [B, (H + 2 Hkv) * D] output, as transformers passes them
    fused = torch.randn(seqs, (heads + 2 * kv_heads) * head_dim)
    query, key, value = (part.view(1, seqs, -1, head_dim).transpose(1, 2)
                         for part in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1))
    new_slots = key_slots[torch.arange(seqs), torch.tensor(key_counts) - 1]
    return {"query": query, "key": key, "value": value, "k_pool": k_pool, "v_pool": v_pool, "new_slots": new_slots,
            "key_slots": key_slots, "key_counts": torch.tensor(key_counts)}


def _run_kernel(case: dict, scale: float = 0.125) -> torch.Tensor:
    return load_decode_attention().decode(**case, scale=scale)


@needs_kernel
@KV_DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 12), (8, 1, 128), (16, 4, 64), (20, 4, 32)])
def test_decode_kernel_writes_the_new_keys_and_matches_sdpa_for_any_head_layout_and_length(heads, kv_heads, head_dim, kv_dtype):
    key_counts = [1, 7, 8, 9, 33, 130]  # lengths around the 8-wide vector exp, and a long one
    case = _kernel_case(len(key_counts), heads, kv_heads, head_dim, key_counts, kv_dtype)
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()  # what the pool must hold afterwards
    # torch's own rounding to the pool's dtype: the kernel's decode writes and torch's prefill writes agree
    k_pool.index_copy_(0, case["new_slots"], case["key"][0].transpose(0, 1).to(kv_dtype))
    v_pool.index_copy_(0, case["new_slots"], case["value"][0].transpose(0, 1).to(kv_dtype))
    got = _run_kernel(case)
    assert torch.equal(case["k_pool"], k_pool) and torch.equal(case["v_pool"], v_pool)
    k_pool, v_pool = k_pool.float(), v_pool.float()
    for b, n in enumerate(key_counts):
        slots = case["key_slots"][b, :n]
        keys = k_pool[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # [H, n, D]
        values = v_pool[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        expected = F.scaled_dot_product_attention(case["query"][0, :, b : b + 1], keys, values, scale=0.125)  # [H, 1, D]
        torch.testing.assert_close(got[0, b], expected[:, 0], rtol=1e-5, atol=1e-5)


@needs_kernel
@KV_DTYPES
def test_decode_kernel_gives_a_sequence_the_same_bits_alone_in_a_batch_and_on_one_thread(kv_dtype):
    case = _kernel_case(5, 9, 3, 64, [3, 50, 17, 64, 9], kv_dtype)
    batched = _run_kernel(case)
    one = {name: t[:, :, 1:2] if name in ("query", "key", "value") else t for name, t in case.items()}
    one.update(new_slots=case["new_slots"][1:2], key_slots=case["key_slots"][1:2, :50].contiguous(), key_counts=case["key_counts"][1:2])
    assert torch.equal(_run_kernel(one)[0, 0], batched[0, 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_run_kernel(case), batched)
    finally:
        torch.set_num_threads(threads)
