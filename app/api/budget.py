"""What one prompt may hold and generate within the model's context and vocabulary, checked before the engine sees
it: each limit a 400 naming the field a client can change (``context_length_exceeded`` for the context's)."""

from __future__ import annotations

from app.api.errors import NO_TOKEN_LEFT, APIError
from app.engine import SamplingParams


def room_left(prompt_ids: list[int], vocab_size: int, max_model_len: int, prompt_field: str) -> int:
    """How many tokens the context holds after the prompt (at least one, else a 400); the prompt's tokens must all be
    in the model's vocabulary."""
    if not prompt_ids:
        raise APIError(400, "the prompt must contain at least one token", param="prompt")
    if max(prompt_ids) >= vocab_size:  # a tokenizer with tokens the model has no embedding for
        raise APIError(400, f"the prompt holds token {max(prompt_ids)}, past the model's vocabulary of {vocab_size} "
                       "(its tokenizer has tokens the model was not resized for): leave them out", param=prompt_field)
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(prompt_ids)}. Shorten the prompt.", param=prompt_field, code="context_length_exceeded")
    return room


def capped_max_tokens(max_tokens: int | None, room: int, request, max_model_len: int, default: int | None = None) -> int:
    """``max_tokens`` (unset in chat: the model's ``default``, else the room left) capped by the room the prompt leaves, as vLLM
    caps it (the answer then ends as "length"); more than the whole context, or a ``min_tokens`` the room cannot hold,
    is a 400."""
    if max_tokens is not None and max_tokens > max_model_len:
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; {field} asks for "
                       f"{max_tokens}, more than the whole context. Lower {field} (at most {room} fit after this prompt).",
                       param=field, code="context_length_exceeded")
    if request.min_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{max_model_len - room}, which leaves room for {room}, fewer than min_tokens "
                       f"({request.min_tokens}).", param="min_tokens", code="context_length_exceeded")
    if not hasattr(request, "messages"):  # completions: unset is 16 (OpenAI's), null the room itself
        default = None
    return min(room, max_tokens if max_tokens is not None else default or room)


def check_token_ids(sampling: SamplingParams, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
    """Token ids a request names (stop_token_ids, logit_bias, allowed_token_ids) are the model's, and what it bans
    leaves a token to choose: under min_tokens, and wherever allowed_token_ids meet bad_words."""
    named = (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", [t for t, _ in sampling.logit_bias]),
             ("allowed_token_ids", sampling.allowed_token_ids))
    for param, ids in named:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise APIError(400, f"{param} token ids must be in [0, {vocab_size}); got {outside[0]}", param=param)
    if sampling.min_tokens and len(set(sampling.stop_token_ids)) >= vocab_size:
        raise APIError(400, "stop_token_ids holds every token of the vocabulary, so min_tokens leaves none to choose",
                       param="stop_token_ids", code=NO_TOKEN_LEFT)
    if not sampling.allowed_token_ids:
        return
    left = set(sampling.allowed_token_ids) - {word[0] for word in sampling.bad_words_token_ids if len(word) == 1}
    if not left:
        raise APIError(400, "every token of allowed_token_ids is a bad word: no token is left to choose",
                       param="allowed_token_ids", code=NO_TOKEN_LEFT)
    stops = set(sampling.stop_token_ids) | set(eos_token_ids)  # min_tokens bans EOS under ignore_eos too, as vLLM
    if sampling.min_tokens and not left - stops:
        raise APIError(400, "allowed_token_ids hold only EOS and stop tokens, which min_tokens bans: no token is left to "
                       "choose", param="allowed_token_ids", code=NO_TOKEN_LEFT)
