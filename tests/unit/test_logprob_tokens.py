"""Logprobs' token strings: each token's text as it reads inside the answer, its bytes the text's."""

import pytest

from app.api.logprobs import LogprobFormatter
from app.engine.request import TokenLogprob
from tests.unit.sentencepiece_tokenizer import sentencepiece_tokenizer

TEXT = "Hello world 😀 你, it is."


@pytest.mark.parametrize("legacy", [True, False])
def test_a_sentencepiece_tokens_string_keeps_its_word_initial_space_and_the_bytes_join_to_the_text(legacy):
    """Decoded alone, ``▁wor`` reads "wor" (a decoder strips a text's first space): the strings and bytes of
    logprobs would then say "Helloworld" and the completions' text offsets would drift one per word."""
    tokenizer = sentencepiece_tokenizer(legacy)
    formatter = LogprobFormatter(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chat = formatter.chat([TokenLogprob(i, -1.0) for i in ids])["content"]
    assert [entry["token"] for entry in chat[:4]] == [" Hello", " wor", "l", "d"]
    assert bytes(b for entry in chat for b in entry["bytes"]) == (" " + TEXT).encode()  # the first word's space too
    completion = formatter.completion([TokenLogprob(i, -1.0) for i in ids])
    assert completion["text_offset"][:4] == [0, 6, 10, 11]


def test_the_space_is_kept_where_the_anchor_word_is_several_tokens():
    tokenizer = sentencepiece_tokenizer(corpus=["Hello world, this is the test.", "Yes it is, hello there friend."] * 20)
    assert len(tokenizer.encode("a", add_special_tokens=False)) > 1  # no word "a" in its vocabulary
    formatter = LogprobFormatter(tokenizer)
    assert [formatter.token_text(i) for i in tokenizer.encode("Hello world,", add_special_tokens=False)] == [" Hello", " world,"]


def test_an_echoed_prompts_offsets_follow_the_echoed_text():
    """The echo starts the text: its first token reads as it does there (no space), and every offset after it points
    at its token in the text."""
    tokenizer = sentencepiece_tokenizer()
    text = "Hello world, it is."
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = [None] + [TokenLogprob(i, -1.0) for i in ids[1:]]
    logprobs = LogprobFormatter(tokenizer).completion([], ids, prompt, width=0)
    pieces = [text[offset:offset + len(token)] for token, offset in zip(logprobs["tokens"], logprobs["text_offset"])]
    assert pieces == logprobs["tokens"] and "".join(logprobs["tokens"]) == text


def test_a_vocabulary_whose_tokens_decode_alone_as_in_a_text_is_decoded_alone():
    class Bytes:  # byte-level BPE's behaviour: no space to restore
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode("utf-8", errors="replace")

    formatter = LogprobFormatter(Bytes())
    assert formatter.token_text(ord("a")) == "a" and formatter._anchor is None


async def test_an_echoed_prompts_logprobs_are_formatted_and_written_off_the_event_loop(tools_server, monkeypatch):
    """A streamed echo's first chunk carries the whole prompt's logprobs (5.4k tokens with 20 alternatives each:
    ~0.9 s to format, ~0.2 s to write): on the event loop, every other stream of the replica would wait that long."""
    import threading

    from app.api.protocol import CompletionRequest, parse_body
    from deployments import http_answers

    loop_thread, threads = threading.current_thread(), {}
    formatting, writing = LogprobFormatter.completion, http_answers._sse

    def formatted(self, logprobs, prompt_ids=None, *args, **kwargs):
        threads.setdefault("format", []).append(threading.current_thread()) if prompt_ids else None
        return formatting(self, logprobs, prompt_ids, *args, **kwargs)

    def written(data, named=False):
        threads.setdefault("write", []).append(threading.current_thread())
        return writing(data, named)

    monkeypatch.setattr(LogprobFormatter, "completion", formatted)
    monkeypatch.setattr(http_answers, "_sse", written)
    body = {"prompt": "x" * 300, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    chunks = [chunk async for chunk in tools_server.serving.completion_stream(parse_body(body, CompletionRequest))]
    assert chunks[0]["choices"][0]["text"].startswith(body["prompt"])
    assert threads["format"] and loop_thread not in threads["format"]  # the echoed chunk's
    echoed = {**chunks[0], "choices": [{**chunks[0]["choices"][0], "logprobs": {"tokens": ["x"] * 300}}]}  # as a model's
    events = [await http_answers._sse_event(chunk, False) for chunk in (echoed, chunks[-1])]
    assert events[0].startswith("data: ") and threads["write"][0] is not loop_thread
    assert threads["write"][-1] is loop_thread  # a small chunk: written in place


async def test_a_whole_answer_with_logprobs_is_written_off_the_event_loop(monkeypatch):
    import json
    import threading

    from deployments import http_answers

    threads, rendering = [], http_answers.JSONResponse.render

    def render(self, content):
        threads.append(threading.current_thread())
        return rendering(self, content)

    monkeypatch.setattr(http_answers.JSONResponse, "render", render)
    with_logprobs = {"choices": [{"text": "x", "logprobs": {"tokens": ["x"] * 300}}]}
    plain = {"choices": [{"text": "x", "logprobs": None}]}
    answers = [await http_answers.json_answer(body) for body in (with_logprobs, plain)]
    assert json.loads(answers[0].body) == with_logprobs and json.loads(answers[1].body) == plain
    assert threads[0] is not threading.current_thread() and threads[1] is threading.current_thread()
