"""vLLM's request extras, beside OpenAI's fields: the token ids (``return_token_ids``), the prompt's logprobs
(``prompt_logprobs``), a long prompt cut to size (``truncate_prompt_tokens``), each chunk's usage so far
(``stream_options.continuous_usage_stats``), ``bad_words`` as token sequences and a chat's ``echo``."""

from __future__ import annotations

from app.api.errors import APIError
from app.api.fanout import Prepared
from app.api.logprobs import LogprobFormatter
from app.engine.request import MAX_BAD_WORDS


def truncated(prompt_ids: list[int], keep: int | None, side: str, max_model_len: int) -> list[int]:
    """At most ``keep`` of the prompt's tokens, its last ones (``side`` "right": its first); -1: as many as leave one
    token of the context to generate; None: the prompt as it is."""
    if keep is None:
        return prompt_ids
    if keep > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({keep}) is past the model's context of {max_model_len} tokens: "
                       "give at most that, or -1 for the context less one", param="truncate_prompt_tokens")
    keep = max_model_len - 1 if keep == -1 else keep
    if len(prompt_ids) <= keep:
        return prompt_ids
    return prompt_ids[len(prompt_ids) - keep:] if side == "left" else prompt_ids[:keep]


def add_to_completion_choices(choices: list[dict], plans: list[Prepared], request, logprobs: LogprobFormatter) -> None:
    """Each completion choice's prompt and answer token ids, and its prompt's logprobs, where the request asked."""
    for choice, p in zip(choices, plans):
        if request.return_token_ids:
            choice.update(prompt_token_ids=p.prompt_token_ids, token_ids=p.token_ids)
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = logprobs.vllm_prompt(p.prompt_logprobs, request.prompt_logprobs)


def add_to_chat_response(response: dict, plans: list[Prepared], request, logprobs: LogprobFormatter) -> None:
    """A chat answer's prompt token ids and prompt logprobs once (its choices share the prompt), each choice's ids."""
    if request.return_token_ids:
        for choice, p in zip(response["choices"], plans):
            choice["token_ids"] = p.token_ids
        response["prompt_token_ids"] = plans[0].prompt_token_ids
    if request.prompt_logprobs is not None:
        response["prompt_logprobs"] = logprobs.vllm_prompt(plans[0].prompt_logprobs, request.prompt_logprobs)


def choice_usage(prepared: Prepared, generated: int) -> dict:
    """One choice's usage so far, as vLLM's continuous_usage_stats gives it in each chunk: its prompt and its tokens."""
    prompt = len(prepared.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def bad_words_token_ids(tokenizer, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the tokens that write it, as vLLM reads them: the word (leading spaces stripped) alone, and
    after a space where that is a different first token and as many tokens (a word in mid-sentence)."""
    sequences: list[tuple[int, ...]] = []
    for word in dict.fromkeys(word.lstrip() for word in words or ()):  # each once (a list of repeats is one word)
        alone = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not alone:
            raise APIError(400, "bad_words holds an entry that is no token (empty, or spaces): give words with text",
                           param="bad_words")
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:  # as vLLM counts them: tokenizing stops at the first past the bound
            raise APIError(400, f"bad_words: at most {MAX_BAD_WORDS} words as tokenized (a word can count twice: alone "
                           "and after a space)", param="bad_words")
    return tuple(sequences)


def echoed_turn(request) -> str | None:
    """vLLM's chat ``echo``: the last message's text, where it is the assistant's (the answer continues it)."""
    last = request.messages[-1]
    return last.text() if request.echo and last.role == "assistant" else None
