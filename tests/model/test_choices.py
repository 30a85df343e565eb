"""One OpenAI request, several choices (app/api/fanout.py) on the real model: lists of prompts, n, best_of,
streamed and not; choice index = prompt_index * n + j; choice j of a seeded request draws from seed + j."""

import itertools

import pytest

from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tests.model.conftest import transformers_model

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Water boils at"]


async def _complete(server, **body):
    return await server.serving.completion(parse_body({"max_tokens": 8, **body}, CompletionRequest))


async def _stream(server, cls, **body):
    method = server.serving.completion_stream if cls is CompletionRequest else server.serving.chat_stream
    return [chunk async for chunk in method(parse_body({"max_tokens": 8, "stream": True, **body}, cls))]


def _texts(response) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in sorted(response["choices"], key=lambda c: c["index"])]


async def test_a_list_of_prompts_answers_each_in_order_as_it_would_alone(server_fp32):
    together = await _complete(server_fp32, prompt=PROMPTS, temperature=0)
    alone = [(await _complete(server_fp32, prompt=p, temperature=0))["choices"][0]["text"] for p in PROMPTS]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2, 3] and _texts(together) == alone
    ids = [server_fp32.info.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_ids = await _complete(server_fp32, prompt=ids, temperature=0)  # lists of token-id lists too
    assert _texts(by_ids) == alone[:2]
    assert together["usage"]["prompt_tokens"] == sum(len(server_fp32.info.tokenizer.encode(p)) for p in PROMPTS)
    assert together["usage"]["completion_tokens"] == 4 * 8


async def test_n_choices_differ_and_come_back_with_the_same_seed(server_fp32):
    body = dict(prompt="Once upon a time", n=3, temperature=1.0, seed=5, min_tokens=8)
    first, again = await _complete(server_fp32, **body), await _complete(server_fp32, **body)
    assert len(set(_texts(first))) == 3 and _texts(first) == _texts(again)
    alone = await _complete(server_fp32, prompt="Once upon a time", temperature=1.0, seed=6, min_tokens=8)
    assert _texts(first)[1] == alone["choices"][0]["text"]  # choice 1 draws from seed + 1


async def test_prompts_times_n_are_indexed_prompt_after_prompt(server_fp32):
    response = await _complete(server_fp32, prompt=PROMPTS[:2], n=2, temperature=0)
    texts = _texts(response)
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert texts[0] == texts[1] != texts[2] == texts[3]  # greedy: a prompt's choices agree


async def test_best_of_returns_the_most_likely_candidates(server_fp32):
    body = dict(prompt="Once upon a time", temperature=1.0, seed=11, min_tokens=8)
    every = await _complete(server_fp32, n=4, logprobs=0, **body)
    ranked = sorted(every["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    best = await _complete(server_fp32, n=2, best_of=4, **body)
    assert _texts(best) == [c["text"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])  # computed to rank them, not asked for


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
async def test_streamed_choices_assemble_to_the_non_streamed_ones(server_fp32, cls):
    if cls is CompletionRequest:
        body = dict(prompt="Once upon a time", n=2, temperature=0.9, seed=3, min_tokens=8)
        expected = _texts(await _complete(server_fp32, **body))
    else:
        body = dict(messages=[{"role": "user", "content": "Tell me a story."}], n=2, temperature=0.9, seed=3, min_tokens=8)
        expected = _texts(await server_fp32.serving.chat(parse_body({"max_tokens": 8, **body}, cls)))
    chunks = await _stream(server_fp32, cls, stream_options={"include_usage": True}, **body)
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice.get("text") or choice.get("delta", {}).get("content") or ""
    assert [texts[0], texts[1]] == expected
    assert chunks[-1]["usage"]["completion_tokens"] == 16 and len({c["id"] for c in chunks}) == 1
    if cls is ChatCompletionRequest:  # a role chunk per choice, before their content
        assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
async def test_a_stream_sends_a_chunk_for_every_token_even_one_with_no_text(server_fp32, cls):
    """Past its answer (``ignore_eos``) the model writes its chat template's special tokens, which the text leaves
    out: each still goes out, in an empty chunk, so a client counts every token as it comes (as vLLM's). A chunk
    holds one token while the reader keeps up, and the tokens that queued meanwhile when it falls behind (a busy
    machine): counted by their logprobs, every token is in exactly one chunk."""
    question = "What is 2 + 2?"
    body = dict(temperature=0, max_tokens=48, ignore_eos=True, stream_options={"include_usage": True})
    if cls is CompletionRequest:
        body["prompt"] = server_fp32.info.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                                        add_generation_prompt=True, tokenize=False)
        body["logprobs"] = 0
    else:
        body["messages"] = [{"role": "user", "content": question}]
        body["logprobs"] = True
    chunks = await _stream(server_fp32, cls, **body)
    choices = [c["choices"][0] for c in chunks if c["choices"] and not c["choices"][0].get("delta", {}).get("role")]
    texts = [c.get("text", c.get("delta", {}).get("content")) for c in choices]
    tokens_per_chunk = [len(c["logprobs"]["tokens"] if cls is CompletionRequest else c["logprobs"]["content"])
                        for c in choices]
    assert min(tokens_per_chunk) >= 1 and sum(tokens_per_chunk) == chunks[-1]["usage"]["completion_tokens"] == 48
    assert "" in texts[:-1]  # a token with no text of its own was streamed (the special tokens after the answer)


async def test_echo_with_logprobs_gives_every_prompt_tokens_logprob_as_transformers(server_fp32, loaded_fp32):
    """lm-evaluation-harness' loglikelihood request: echo, logprobs: 1, max_tokens: 1. The prompt's blocks are in
    the prefix cache the second time (a plain request sent it first): every prompt token still gets its logprob."""
    import torch

    prompt = "The quick brown fox jumps over the lazy dog. " * 4 + "Then it"
    ids = loaded_fp32.tokenizer.encode(prompt)
    with torch.inference_mode():
        reference = transformers_model(loaded_fp32)(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    for attempt in range(2):
        response = await _complete(server_fp32, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
        choice = response["choices"][0]
        lps = choice["logprobs"]
        assert choice["text"].startswith(prompt) and len(lps["tokens"]) == len(ids) + 1
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(lps["token_logprobs"][i] - float(reference[i - 1, ids[i]])) < 1e-4, (attempt, i)
            assert len(lps["top_logprobs"][i]) >= 1
        await _complete(server_fp32, prompt=prompt, max_tokens=1, temperature=0)  # caches the prompt's blocks
    streamed = await _stream(server_fp32, CompletionRequest, prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    first = streamed[0]["choices"][0]
    assert first["text"].startswith(prompt) and first["logprobs"]["token_logprobs"][0] is None


async def test_prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_alternatives_as_transformers(server_fp32, loaded_fp32):
    """vLLM's ``prompt_logprobs: k``: per prompt token (the first None) its id -> logprob, rank and text, then its k
    likeliest alternatives ranked 1..k, on completions (per choice) and chat (once); beside echo with fewer
    ``logprobs``, the echoed prompt's alternatives stay as many as ``logprobs`` asks."""
    import torch

    prompt = "The capital of France is Paris, and the capital of Spain is"
    ids = loaded_fp32.tokenizer.encode(prompt)
    with torch.inference_mode():
        reference = transformers_model(loaded_fp32)(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    response = await _complete(server_fp32, prompt=prompt, prompt_logprobs=3, max_tokens=1, echo=True, logprobs=1)
    choice = response["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        row, token = reference[i - 1], ids[i]
        entry = scored[i][str(token)]
        assert abs(entry["logprob"] - float(row[token])) < 1e-4 and entry["rank"] == int((row > row[token]).sum()) + 1
        assert entry["decoded_token"] == loaded_fp32.tokenizer.decode([token])
        alternatives = [(int(t), e["rank"]) for t, e in scored[i].items() if e["rank"] <= 3]
        assert sorted(rank for _, rank in alternatives) == [1, 2, 3]
        assert {t for t, _ in alternatives} == set(row.topk(3).indices.tolist())
        assert len(choice["logprobs"]["top_logprobs"][i]) <= 2  # echo's logprobs: 1 (+ the token itself)
    chat = {"messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 0, "max_tokens": 1}
    answer = await server_fp32.serving.chat(parse_body(chat, ChatCompletionRequest))
    assert answer["prompt_logprobs"][0] is None and all(len(entry) == 1 for entry in answer["prompt_logprobs"][1:])
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]


async def test_max_tokens_0_with_echo_scores_the_prompt_alone(server_fp32, loaded_fp32):
    """Prompt scoring as vLLM answers it (OpenAI's legacy completions took it too): max_tokens 0 with echo gives the
    prompt, its tokens' logprobs (the same as with max_tokens 1) and no answer, streamed or not."""
    prompt = "The capital of France is Paris, and the capital of Spain is"
    ids = loaded_fp32.tokenizer.encode(prompt)
    one = (await _complete(server_fp32, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0))["choices"][0]
    response = await _complete(server_fp32, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = response["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert response["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert choice["logprobs"] == {key: values[:len(ids)] for key, values in one["logprobs"].items()}
    streamed = await _stream(server_fp32, CompletionRequest, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == prompt
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in streamed if c["choices"]) == len(ids)


@pytest.mark.parametrize("echo", [False, True])
async def test_streamed_logprobs_continue_the_offsets_and_every_token_is_among_its_alternatives(server_fp32, echo):
    """OpenAI's completions logprobs: a token's alternatives hold the token itself (up to logprobs + 1 entries), and
    a stream's chunks together give the text offsets of the whole answer, as the answer in one piece does."""
    body = {"prompt": "Once upon a time", "echo": echo, "logprobs": 1, "temperature": 1.5, "seed": 3, "max_tokens": 8}
    whole = (await _complete(server_fp32, **body))["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in await _stream(server_fp32, CompletionRequest, **body) if c["choices"]]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"]
    assert whole["text_offset"] == list(itertools.accumulate((len(t) for t in whole["tokens"][:-1]), initial=0))
    for token, value, top in zip(whole["tokens"], whole["token_logprobs"], whole["top_logprobs"]):
        assert top is None if value is None else (top[token] == value and len(top) <= 2), (token, top)
    assert sum(len(top) == 2 for top in whole["top_logprobs"] if top) >= 1  # some token was not the most likely


async def test_a_token_holding_part_of_a_character_gives_its_own_bytes(server_fp32, loaded_fp32):
    """OpenAI's chat logprob ``bytes`` are the token's bytes: for a token that is one byte of a multi-byte character
    (its text alone is U+FFFD), not the replacement character's."""
    token = next(t for t in range(1000) if loaded_fp32.tokenizer.decode([t]) == "\ufffd")
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "max_tokens": 1, "logit_bias": {str(token): 100}}
    answer = await server_fp32.serving.chat(parse_body(body, ChatCompletionRequest))
    [entry] = answer["choices"][0]["logprobs"]["content"]
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # SmolLM2's is byte-level BPE: a char per byte

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    expected = [byte_of[char] for char in loaded_fp32.tokenizer.convert_ids_to_tokens(token)]
    assert entry["token"] == "\ufffd" and entry["bytes"] == expected != list("\ufffd".encode())
