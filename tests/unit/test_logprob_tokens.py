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
    assert formatter._anchor is None and formatter.token_text(ord("a")) == "a"
