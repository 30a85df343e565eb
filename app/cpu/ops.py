"""Load the CPU kernels as torch ops (``torch.ops.llm_serve.*``) and give each a fake implementation.

:func:`load_ops` builds the library (``build.py``) and loads it once per process; afterwards every op
is an ordinary torch operator: it checks its arguments' dtype, device and shape in C++, shows in torch's
profiler under its own name, and (through the fakes below) traces under ``torch.compile``. Where the
library cannot be built or loaded, :func:`unavailable_reason` says why and callers keep torch's ops.
"""

from __future__ import annotations

import functools
import subprocess

import torch

from app.cpu import build

OPS = torch.ops.llm_serve


@functools.cache
def load_ops() -> str | None:
    """Build and load the ops library; returns None when loaded, else why it is not (computed once)."""
    reason = build.unsupported_reason()
    if reason is not None:
        return reason
    try:
        torch.ops.load_library(str(build.build_library()))
    except subprocess.CalledProcessError as exc:
        command = " ".join(map(str, exc.cmd))
        return (f"compiling the CPU kernels failed: `{command[:200]}` exited with {exc.returncode}"
                + (f": {exc.stderr.strip()[-500:]}" if (exc.stderr or "").strip() else ""))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"building or loading the CPU kernels failed: {exc}"
    _register_fakes()
    return None


def available() -> bool:
    return load_ops() is None


def unavailable_reason() -> str | None:
    return load_ops()


@functools.cache  # once per process, like the library: ``load_ops`` runs again after its cache is cleared (tests
# turn the kernels off and on), and some torch releases (2.11, seen) refuse a second fake for the same op
def _register_fakes() -> None:
    """Shapes and dtypes of each op's outputs, for tracing (torch.compile, meta tensors)."""
    fake = torch.library.register_fake

    @fake("llm_serve::pack_linear_weight")
    def _(weight, dtype):
        n, k = weight.shape
        return weight.new_empty((-(-n // 16) * 16 * k,), dtype=dtype)

    @fake("llm_serve::linear")
    def _(x, packed, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @fake("llm_serve::linear_bf16dot")
    def _(x, packed, bias, out_features, residual=None):
        return x.new_empty((*x.shape[:-1], out_features))

    @fake("llm_serve::linear_int4_bf16dot")
    def _(x, codes, scales, zeros, bias, out_features, group_size):
        return x.new_empty((*x.shape[:-1], out_features))

    @fake("llm_serve::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake("llm_serve::silu_mul")
    def _(gate_up, lanes):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @fake("llm_serve::rotary")
    def _(q, k, cos, sin):
        return _rotary_like(q), _rotary_like(k)

    @fake("llm_serve::argmax_rows")
    def _(x):
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @fake("llm_serve::decode_attention")
    def _(query, key, value, k_pool, v_pool, new_slots, key_slots, key_counts, scale):
        _, heads, seqs, head_dim = query.shape
        return query.new_empty((1, seqs, heads, head_dim))

    @fake("llm_serve::prefill_attention")
    def _(query, k_pool, v_pool, key_slots, query_seq, query_keys, scale):
        _, heads, tokens, head_dim = query.shape
        return query.new_empty((1, tokens, heads, head_dim))


def _rotary_like(x: torch.Tensor) -> torch.Tensor:
    batch, heads, tokens, dim = x.shape
    return x.new_empty_strided((batch, heads, tokens, dim), (tokens * heads * dim, dim, heads * dim, 1))
