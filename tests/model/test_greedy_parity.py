"""The engine's greedy output is transformers' own, token for token (fp32)."""

import asyncio

import pytest

from app.engine import Request, SamplingParams
from tests.model.conftest import PARITY_TOKENS, PROMPTS, hf_greedy_divergence

pytestmark = pytest.mark.model


async def _engine_tokens(server, prompt_ids, **params):
    request = Request("r-" + str(abs(hash(tuple(prompt_ids)))), prompt_ids, SamplingParams(**params), server.info.eos_token_ids)
    tokens = []
    async for output in server.engine.generate(request):
        tokens.extend(output.new_token_ids)
    return tokens


async def test_greedy_tokens_are_transformers_own(server_fp32, loaded_fp32):
    """Through the whole server path: AsyncEngine, the engine process, paged attention; the prompts sent together
    (the engine is batch-invariant: each answers as it would alone, tests/model/test_engine_modes.py)."""
    prompts = [loaded_fp32.tokenizer.encode(prompt) for prompt in PROMPTS[:6]]
    got = await asyncio.gather(*(_engine_tokens(server_fp32, ids, max_tokens=PARITY_TOKENS, temperature=0, ignore_eos=True)
                               for ids in prompts))
    differences = {PROMPTS[i]: where for i, ids in enumerate(prompts)
                   if (where := hf_greedy_divergence(loaded_fp32, ids, got[i], PARITY_TOKENS))}
    assert not differences, f"differs from transformers' greedy output: {differences}"


async def test_seeded_sampling_reproducible(server_fp32):
    ids = server_fp32.info.tokenizer.encode("Write a story:")
    first = await _engine_tokens(server_fp32, ids, max_tokens=12, temperature=1.0, seed=3)
    second = await _engine_tokens(server_fp32, ids, max_tokens=12, temperature=1.0, seed=3)
    assert first == second and len(first) == 12


async def test_chat_answers_capital_question(server_fp32):
    from app.api.protocol import ChatCompletionRequest, parse_body

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
    response = await server_fp32.serving.chat(parse_body(body, ChatCompletionRequest))
    assert "Paris" in response["choices"][0]["message"]["content"]
    assert response["usage"]["completion_tokens"] > 0


async def test_stop_string_ends_output(server_fp32):
    from app.api.protocol import CompletionRequest, parse_body

    body = {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 20, "stop": ["7"]}
    response = await server_fp32.serving.completion(parse_body(body, CompletionRequest))
    choice = response["choices"][0]
    assert choice["finish_reason"] == "stop" and "7" not in choice["text"] and "6" in choice["text"]


async def test_include_stop_str_in_output_keeps_what_ended_the_output_streamed_or_not(server_fp32):
    """vLLM's ``include_stop_str_in_output``: the stop string, or a stop token's text, ends the text instead of being
    cut from it; a stream carries the same text."""
    from app.api.protocol import CompletionRequest, parse_body

    async def text(**fields) -> tuple[str, str]:
        body = {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 20, **fields}
        whole = (await server_fp32.serving.completion(parse_body(body, CompletionRequest)))["choices"][0]["text"]
        chunks = server_fp32.serving.completion_stream(parse_body({**body, "stream": True}, CompletionRequest))
        return whole, "".join([c["choices"][0]["text"] async for c in chunks if c["choices"]])

    cut, kept = await text(stop=["7"]), await text(stop=["7"], include_stop_str_in_output=True)
    assert kept[0] == kept[1] == cut[0] + "7" and cut[0] == cut[1] and "6" in cut[0]
    comma = server_fp32.serving.tokenizer.convert_tokens_to_ids(",")
    cut, kept = await text(stop_token_ids=[comma]), await text(stop_token_ids=[comma], include_stop_str_in_output=True)
    assert kept[0] == kept[1] == cut[0] + "," and cut[0] == cut[1] and "," not in cut[0]


def test_load_errors_name_the_model():
    from app.config import ModelConfig
    from app.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="/no/such/dir"):
        load_model(ModelConfig(source="/no/such/dir"))
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        load_model(ModelConfig(source="./missing.gguf"))
