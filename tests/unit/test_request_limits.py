"""What a replica refuses with a 400 before any work: requests it could never run (more choices than it ever holds,
a vocabulary wholly stopped under min_tokens), on the real serving layer over the fake model (no Ray)."""

import pytest

from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.config import AppConfig
from tests.serve.fake_model import fake_model_server


@pytest.fixture
def server():
    served = {"model": {"source": "fake-limits"}, "engine": {"separate_process": False, "max_num_seqs": 2, "max_queued_requests": 2}}
    server = fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    yield server
    server.shutdown(timeout_s=1)


async def test_more_choices_than_the_replica_ever_holds_is_a_400_and_as_many_answer(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(APIError) as info:
        await server.serving.chat(parse_body({**chat, "n": 5}, ChatCompletionRequest))
    assert (info.value.status, info.value.param) == (400, "n") and "holds at once (4" in info.value.message
    answer = await server.serving.chat(parse_body({**chat, "n": 4}, ChatCompletionRequest))
    assert len(answer["choices"]) == 4
    with pytest.raises(APIError, match="3 prompt"):
        await server.serving.completion(parse_body({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}, CompletionRequest))
    with pytest.raises(APIError) as info:
        await server.serving.completion(parse_body({"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, CompletionRequest))
    assert info.value.param == "prompt"


async def test_a_replica_that_holds_more_takes_a_list_of_prompts_past_openais_n_limit(quick_fake_steps):
    """An RL rollout posts its whole batch as one request: the replica's own bound decides, not OpenAI's 128."""
    served = {"model": {"source": "fake-wide"}, "engine": {"separate_process": False, "max_num_seqs": 64, "max_queued_requests": 200}}
    server = fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    try:
        prompts = [f"p{i}" for i in range(200)]
        answer = await server.serving.completion(parse_body({"prompt": prompts, "max_tokens": 2}, CompletionRequest))
        assert [c["text"] for c in answer["choices"]] == [p[:2] for p in prompts]  # the fake echoes each prompt
    finally:
        server.shutdown(timeout_s=1)


async def test_every_token_a_stop_token_under_min_tokens_is_a_400(server):
    body = {"prompt": "x", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": list(range(256))}
    with pytest.raises(APIError) as info:
        await server.serving.completion(parse_body(body, CompletionRequest))
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")
    answer = await server.serving.completion(parse_body({**body, "min_tokens": 0}, CompletionRequest))  # may stop at once
    assert len(answer["choices"]) == 1


async def test_a_prompt_holding_a_token_past_the_models_vocabulary_is_a_400_alone(server, monkeypatch):
    """A fine-tune's tokenizer with added tokens the embeddings were not resized for: its prompt would fail the
    whole step (an index past the embedding), so it is refused before the engine, the others answered."""
    monkeypatch.setattr(server.serving, "vocab_size", ord("h"))  # "h" and later bytes are past it
    with pytest.raises(APIError) as info:
        await server.serving.completion(parse_body({"prompt": "hello", "max_tokens": 2}, CompletionRequest))
    assert (info.value.status, info.value.param) == (400, "prompt") and "past the model's vocabulary of 104" in info.value.message
    answer = await server.serving.completion(parse_body({"prompt": "ABC", "max_tokens": 2}, CompletionRequest))
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_0_with_echo_finishes_length_even_where_the_unshown_token_would_stop(server):
    """The one token computed for a scored prompt is no answer: its stop (here the recorded answer ends at once) is not
    the response's either."""
    from tests.serve.fake_model import REPLAY

    prompt = f"x{REPLAY[0].decode()}Z{REPLAY[1].decode()}"
    for max_tokens, finish in ((1, "stop"), (0, "length")):
        body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1}
        choice = (await server.serving.completion(parse_body(body, CompletionRequest)))["choices"][0]
        assert choice["finish_reason"] == finish and choice["text"] == prompt + ("Z" if max_tokens else "")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_is_tokenized_off_the_event_loop(server, monkeypatch, stream):
    """A long prompt's template and tokenizing (75 ms for 40k tokens) leave the loop, where the replica's streams wait:
    the tokenizer here is held until a task on the loop has run."""
    import asyncio
    import threading

    loop_ran, tokenizer = threading.Event(), server.serving.tokenizer
    encode = tokenizer.encode

    def held_encode(text, *args, **kwargs):
        assert loop_ran.wait(5), "the event loop was held while tokenizing"
        return encode(text, *args, **kwargs)

    async def on_the_loop():
        loop_ran.set()

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    request = parse_body(body, ChatCompletionRequest)
    if stream:
        answer = asyncio.create_task(_drained(server.serving.chat_stream(request)))
    else:
        answer = asyncio.create_task(server.serving.chat(request))
    await asyncio.gather(answer, on_the_loop())
    assert answer.result()


async def _drained(chunks) -> list:
    return [chunk async for chunk in chunks]


@pytest.mark.parametrize("field, value, param", [
    ("logit_bias", {str(token): 1 for token in range(301)}, "logit_bias"),  # each biased token is applied at every step
    ("stop_token_ids", list(range(1025)), "stop_token_ids"),  # each token is checked against them
    ("stop", ["x" * 1025], "stop"),  # the text is searched for each after every token
])
def test_what_every_step_applies_for_a_request_is_bounded(field, value, param):
    body = {"prompt": "x", field: value}
    with pytest.raises(APIError) as info:
        parse_body(body, CompletionRequest).sampling_params(4)
    assert (info.value.status, info.value.param) == (400, param)
    shortened = {key: v[:-1] if isinstance(v, list) else dict(list(v.items())[:-1]) for key, v in {field: value}.items()}
    shortened = {"stop": ["x" * 1024]} if field == "stop" else shortened
    parse_body({"prompt": "x", **shortened}, CompletionRequest).sampling_params(4)  # at the bound: taken


def test_repeated_stop_token_ids_count_once():
    sampling = parse_body({"prompt": "x", "stop_token_ids": [5] * 5000}, CompletionRequest).sampling_params(4)
    assert sampling.stop_token_ids == (5,)


def test_more_prompts_than_choices_are_refused_before_any_is_tokenized():
    with pytest.raises(APIError) as info:
        parse_body({"prompt": ["a"] * 2049, "n": 2}, CompletionRequest)
    assert (info.value.status, info.value.param) == (400, "prompt") and "2049 prompts x 2 choices" in info.value.message
    assert parse_body({"prompt": ["a"] * 2048, "n": 2}, CompletionRequest)
    assert parse_body({"prompt": [1] * 500, "n": 128}, CompletionRequest)  # token ids: one prompt
