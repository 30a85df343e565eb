"""The model-free core of speculative decoding: verify drafts, propose drafts, size them, count them.

- ``rejection.py``: the lossless rejection sampler (batched, padded drafts with per-sequence lengths).
- ``probs.py``: logits -> the request's processed distribution (the engine sampler's own steps), for p and q.
- ``ngram.py``: the n-gram / prompt-lookup proposer (a drafter with no model and no probabilities).
- ``policy.py``: the per-sequence draft length (acceptance EMA, batch size, cost ratio, re-probing).
- ``stats.py``: acceptance counters under vLLM's names, mergeable and serializable.

Nothing here imports ray or reaches into the engine's internals: inputs are tensors, token lists and
the engine's public ``Request`` / ``SamplingParams``. See docs/engine.md, "Speculative decoding".
The names below load on first use: the torch-based parts (and ``processed_probs``, which reuses the engine's
sampler) stay out of processes that only send draft calls or route requests.
"""

import importlib

_EXPORTS = {
    "NgramProposer": "app.spec.ngram",
    "DraftLengthPolicy": "app.spec.policy",
    "DraftPolicyConfig": "app.spec.policy",
    "expected_speedup": "app.spec.policy",
    "expected_tokens_per_step": "app.spec.policy",
    "processed_probs": "app.spec.probs",
    "PLACEHOLDER_TOKEN_ID": "app.spec.rejection",
    "RejectionOutput": "app.spec.rejection",
    "padded_from_packed": "app.spec.rejection",
    "rejection_sample": "app.spec.rejection",
    "SpecDecodingStats": "app.spec.stats",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
