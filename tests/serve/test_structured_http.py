"""Structured outputs through the real app and the real openai SDK: pydantic parsing, JSON mode, regex and
choice constraints on sampled outputs, the n-gram speculative twin, and schemas the grammar engine refuses."""

import concurrent.futures
import json
import re

import openai
import pydantic
import pytest

from tests.serve.conftest import BASE, GPTQ_MODEL, GPTQ_NGRAM_MODEL, MODEL

pytestmark = pytest.mark.serve


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)
    is_capital: bool


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Hanoi", "Quito"]


@pytest.fixture(scope="module")
def oai(serve_app):
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")


def _parse(oai, model: str, city: str):
    return oai.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": f"Describe {city} as JSON."}],
        response_format=City, temperature=0, max_tokens=80,
    )


def test_the_sdks_parse_returns_a_pydantic_object_for_8_prompts_sent_together(oai):
    with concurrent.futures.ThreadPoolExecutor(len(CITIES)) as pool:
        answers = list(pool.map(lambda city: _parse(oai, MODEL, city), CITIES))
    for answer in answers:
        message = answer.choices[0].message
        assert isinstance(message.parsed, City), message.content
        assert answer.choices[0].finish_reason == "stop"


def test_json_mode_output_parses_as_json(oai):
    answer = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=100,
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("constraint, holds", [
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    ({"choice": ["positive", "negative", "neutral"]}, lambda text: text in ("positive", "negative", "neutral")),
])
def test_regex_and_choice_hold_over_20_sampled_outputs(oai, constraint, holds):
    answer = oai.completions.create(model=MODEL, prompt="The review 'I loved it' is", n=20, temperature=1.0, max_tokens=12,
                                    extra_body={"structured_outputs": constraint})
    texts = [choice.text for choice in answer.choices]
    assert len(texts) == 20 and all(holds(text) for text in texts), texts


def test_the_ngram_twin_answers_a_schema_as_its_target_does(oai):
    target, twin = _parse(oai, GPTQ_MODEL, "Rome"), _parse(oai, GPTQ_NGRAM_MODEL, "Rome")
    assert isinstance(twin.choices[0].message.parsed, City)
    assert twin.choices[0].message.content == target.choices[0].message.content


def test_a_schema_the_grammar_engine_cannot_honour_is_a_400_naming_the_keyword(oai):
    schema = {"type": "object", "propertyNames": {"maxLength": 3}}
    with pytest.raises(openai.BadRequestError, match="propertyNames"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
