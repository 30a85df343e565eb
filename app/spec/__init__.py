"""The model-free core of speculative decoding: verify drafts, propose drafts, size them, count them.

- ``rejection.py``: the lossless rejection sampler (batched, padded drafts with per-sequence lengths).
- ``probs.py``: logits -> the request's processed distribution (the engine sampler's own steps), for p and q.
- ``ngram.py``: the n-gram / prompt-lookup proposer (a drafter with no model and no probabilities).
- ``policy.py``: the per-sequence draft length (acceptance EMA, batch size, cost ratio, re-probing).
- ``stats.py``: acceptance counters under vLLM's names, mergeable and serializable.

Nothing here imports ray or reaches into the engine's internals: inputs are tensors, token lists and
the engine's public ``Request`` / ``SamplingParams``. See docs/engine.md, "Speculative decoding".
``processed_probs`` is imported on first use: it reuses ``app.engine.sampling``, and importing anything
under ``app.engine`` runs ``app/engine/__init__.py``, which loads the whole engine (transformers, ~3 s).
"""

from app.spec.ngram import NgramProposer
from app.spec.policy import DraftLengthPolicy, DraftPolicyConfig, expected_speedup, expected_tokens_per_step
from app.spec.rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, padded_from_packed, rejection_sample
from app.spec.stats import SpecDecodingStats

__all__ = [
    "NgramProposer",
    "DraftLengthPolicy",
    "DraftPolicyConfig",
    "expected_speedup",
    "expected_tokens_per_step",
    "processed_probs",
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "padded_from_packed",
    "rejection_sample",
    "SpecDecodingStats",
]


def __getattr__(name: str):
    if name == "processed_probs":
        from app.spec.probs import processed_probs

        return processed_probs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
