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
