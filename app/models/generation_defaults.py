"""The sampling defaults a checkpoint's ``generation_config.json`` recommends, applied as vLLM applies them (its
``--generation-config auto``): a request that leaves temperature, top_p, top_k, min_p, the three penalties or
max_tokens unset takes the checkpoint's value (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05; ``max_new_tokens`` is max_tokens); ``default_sampling`` in the config still wins, then OpenAI's
defaults. ``model.generation_config: none`` leaves them.

What transformers' ``generate`` applies beyond those (suppressed tokens, bad words, n-gram bans, ...) is not applied
here, as in vLLM; the load warns, naming each one the checkpoint sets."""

from __future__ import annotations

import logging

from app.engine.request import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# generation_config's names -> the request's (transformers' max_new_tokens is the answer's max_tokens)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# What transformers' generate applies beyond sampling, each with the value that changes nothing
NOT_APPLIED = {"suppress_tokens": [], "begin_suppress_tokens": [], "bad_words_ids": [], "sequence_bias": {},
               "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "forced_bos_token_id": None,
               "forced_eos_token_id": None, "min_new_tokens": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
               "exponential_decay_length_penalty": None, "num_beams": 1, "penalty_alpha": None, "guidance_scale": 1.0}


def checkpoint_sampling_defaults(model, source: str) -> dict[str, float]:
    """The sampling fields ``model``'s generation config states (transformers 5 leaves unstated ones None)."""
    generation = getattr(model, "generation_config", None)
    if generation is None:
        return {}
    defaults = {}
    for key, field in SAMPLING_KEYS.items():
        value = getattr(generation, key, None)
        if value is None:
            continue
        try:
            SamplingParams(**{field: value})
        except (SamplingParamsError, TypeError, ValueError) as exc:
            logger.warning("model %s: generation_config's %s=%r is not a value a request may take (%s); not applied",
                           source, key, value, exc)
            continue
        defaults[field] = value
    ignored = [key for key, neutral in NOT_APPLIED.items() if getattr(generation, key, None) not in (None, neutral)]
    if ignored:
        logger.warning("model %s: its generation_config sets %s, which transformers' generate applies and this server "
                       "does not (as vLLM)", source, ", ".join(ignored))
    return defaults
