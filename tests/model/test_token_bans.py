"""vLLM's ``allowed_token_ids`` and ``bad_words`` on the real model: masking what greedy decoding would not choose
changes nothing; what is banned never appears."""

import asyncio

import pytest

from app.api.errors import to_api_error
from app.api.extras import bad_words_token_ids
from app.api.protocol import CompletionRequest, parse_body

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


async def _answer(server, **body) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body}
    return (await server.serving.completion(parse_body(body, CompletionRequest)))["choices"][0]


def _holds(ids: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(sequence)]) == sequence for i in range(len(ids) - len(sequence) + 1))


async def test_allowed_tokens_holding_the_greedy_answer_give_it_again_and_others_are_never_chosen(server_fp32):
    plain = await _answer(server_fp32)
    allowed = sorted(set(plain["token_ids"]))
    assert (await _answer(server_fp32, allowed_token_ids=allowed))["token_ids"] == plain["token_ids"]
    narrower = [t for t in allowed if t != plain["token_ids"][0]]
    sampled = await _answer(server_fp32, allowed_token_ids=narrower, temperature=1.0, seed=3)
    assert set(sampled["token_ids"]) <= set(narrower) and sampled["token_ids"][0] != plain["token_ids"][0]


async def test_a_bad_word_the_greedy_answer_starts_with_never_appears_in_it(server_fp32):
    plain = await _answer(server_fp32)
    tokenizer = server_fp32.info.tokenizer
    word = tokenizer.decode(plain["token_ids"][:1])  # the answer's first token as text (" Paris": both forms banned)
    banned = bad_words_token_ids(tokenizer, [word])
    assert any(_holds(plain["token_ids"], s) for s in banned)  # the word, as one of the forms banned
    answer = await _answer(server_fp32, bad_words=[word], max_tokens=16)
    assert not any(_holds(answer["token_ids"], s) for s in banned) and answer["token_ids"][0] != plain["token_ids"][0]


async def test_a_format_the_allowed_tokens_cannot_write_is_a_400_and_a_batch_mate_is_served(server_fp32):
    """json_object's answer starts with "{", which allowed_token_ids leave out: no token is left at the first step."""
    a = server_fp32.info.tokenizer.encode("a", add_special_tokens=False)
    stuck = _answer(server_fp32, allowed_token_ids=a, response_format={"type": "json_object"}, ignore_eos=False)
    results = await asyncio.gather(stuck, _answer(server_fp32), return_exceptions=True)
    error = to_api_error(results[0])
    assert (error.status, error.code) == (400, "no_token_left") and "allowed_token_ids" in error.message
    assert results[1]["token_ids"] == (await _answer(server_fp32))["token_ids"]
