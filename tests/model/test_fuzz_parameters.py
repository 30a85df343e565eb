"""Random extreme-but-well-typed sampling parameters beside ordinary requests, through the serving layer and the
engine process: each odd request is answered (with at most its max_tokens) or refused with a 400 naming a field,
never a 500; the ordinary requests beside it always finish with all their tokens."""

import asyncio
import random

import pytest

from app.api.errors import APIError
from app.api.protocol import CompletionRequest, parse_body

pytestmark = pytest.mark.model

ROUNDS, ODD_PER_ROUND, ORDINARY_PER_ROUND = 8, 6, 2  # 48 odd parameter sets, 16 ordinary requests beside them
VOCAB = 49152

CHOICES = {
    "temperature": [0, 1e-45, 1e-9, 0.7, 2, 2.0000001],
    "top_p": [1e-9, 0.5, 1, 0],
    "top_k": [-1, 0, 1, VOCAB - 1, VOCAB, 10**9, 2**63 - 1, 2**63],
    "min_p": [0, 0.999999, 1],
    "presence_penalty": [-2, 0, 2],
    "frequency_penalty": [-2, 0, 2],
    "repetition_penalty": [1e-9, 1, 100, 0, 101],
    "seed": [0, -1, 2**63 - 1, -(2**63), 2**64 + 5, -(2**63) - 1],
    "stop": [["\n"], ["e"], ["x" * 200], [""], [str(i) for i in range(17)]],
    "stop_token_ids": [[0], [VOCAB - 1], [VOCAB], [-1], [2**63]],
    "min_tokens": [0, 1, 8, 2**63],
    "logprobs": [0, 5, 20, 21],
    "logit_bias": [{"0": 100}, {str(VOCAB - 1): -100, "5": 3.5}, {str(VOCAB): 1}, {"x": 1}, {"5": 101}],
    "ignore_eos": [True, False],
    "skip_special_tokens": [True, False],
}
PROMPTS = ["Hello", "1, 2, 3,", "\u00fc\u00f1\u00ee\u00e7\u00f8d\u00e9 \U0001f642", "x" * 300, [0], [VOCAB - 1, 5, 7], [[1, 2, 3]]]


def _odd_body(rng: random.Random) -> dict:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.choice([1, 3, 8])}
    for name in rng.sample(sorted(CHOICES), k=rng.randint(1, 6)):
        body[name] = rng.choice(CHOICES[name])
    return body


async def _answer(server, body: dict):
    try:
        return await server.serving.completion(parse_body(body, CompletionRequest))
    except APIError as error:
        return error


async def _round(server, odd: list[dict]) -> tuple[list, list]:
    ordinary = [{"prompt": "Once upon a time", "max_tokens": 8, "min_tokens": 8, "temperature": 0.8, "seed": i}
                for i in range(ORDINARY_PER_ROUND)]
    answers = await asyncio.gather(*(_answer(server, body) for body in odd + ordinary))
    return answers[: len(odd)], answers[len(odd) :]


async def test_odd_parameters_never_fail_their_neighbours(server_fp32):
    rng = random.Random(20261125)
    refused = answered = 0
    for _ in range(ROUNDS):
        odd = [_odd_body(rng) for _ in range(ODD_PER_ROUND)]
        odd_answers, ordinary_answers = await _round(server_fp32, odd)
        for body, answer in zip(odd, odd_answers):
            if isinstance(answer, APIError):
                assert answer.status == 400 and answer.param, (body, answer.status, answer.message)
                refused += 1
            else:
                assert answer["usage"]["completion_tokens"] <= body["max_tokens"], body
                assert answer["choices"][0]["finish_reason"] in ("stop", "length"), body
                answered += 1
        for answer in ordinary_answers:
            assert not isinstance(answer, APIError), answer.message
            assert answer["usage"]["completion_tokens"] == 8
    print(f"odd parameter sets: {refused} refused with a 400, {answered} answered")
    assert refused > 0 and answered > 0  # both kinds occurred
