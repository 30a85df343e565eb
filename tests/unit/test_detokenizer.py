from app.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token i is chr(i); enough to test offsets, stop strings and hold-back."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _feed(text, stop=()):
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=stop)
    pieces, stopped = [], False
    for ch in text:
        piece, stopped = detok.add_token(ord(ch))
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(detok.flush())
    return "".join(pieces), stopped, pieces


def test_streams_all_text_without_stop():
    text, stopped, _ = _feed("hello world")
    assert text == "hello world" and not stopped


def test_stop_string_is_cut_and_never_streamed():
    text, stopped, pieces = _feed("abc STOP def", stop=("STOP",))
    assert text == "abc " and stopped
    assert "S" not in "".join(pieces)


def test_with_include_stop_the_text_ends_after_the_earliest_stop_string_and_nothing_past_it_streams():
    def feed(tokens: list[str], stop: tuple[str, ...]) -> tuple[str, str]:
        detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=stop, include_stop=True)
        pieces = []
        for token in tokens:  # a token of several characters: its text after the stop string goes nowhere
            for ch in token[:-1]:
                detok._ids.append(ord(ch))
            piece, stopped = detok.add_token(ord(token[-1]))
            pieces.append(piece)
            if stopped:
                return "".join(pieces), detok.text
        return "".join(pieces) + detok.flush(), detok.text

    assert feed(list("abc STOP def"), ("STOP",)) == ("abc STOP", "abc STOP")
    assert feed(["ab", "c ST", "OP de", "f"], ("STOP",)) == ("abc STOP", "abc STOP")
    assert feed(list("a END b STOP"), ("STOP", "END")) == ("a END", "a END")  # the earliest, whatever the list's order
    assert feed(["abcd"], ("abcd", "bc")) == ("abc", "abc")  # in one token: the one completed first, as vLLM
    assert feed(list("no stop here"), ("STOP",)) == ("no stop here", "no stop here")


class ByteTokenizer:
    """Token i is byte i, decoded as UTF-8 with U+FFFD for bytes that are no character."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_multi_byte_character_waits_for_its_last_byte_and_bytes_that_are_none_go_out_without_growing_the_window():
    detok = IncrementalDetokenizer(ByteTokenizer(), [ord("p")])
    pieces = [detok.add_token(b)[0] for b in "é!".encode()]
    assert pieces == ["", "é", "!"]  # the first byte of é waits for the second
    for _ in range(1000):  # lone continuation bytes (a model biased to one): never a character
        detok.add_token(0x80)
    assert detok.text.startswith("é!\ufffd") and len(detok.text) > 990  # they went out, as U+FFFD
    assert len(detok._ids) - detok._prefix_offset <= 12  # and each decode stayed a short window


def test_a_stop_string_in_text_min_tokens_kept_from_stopping_does_not_stop_later_whatever_the_others_lengths():
    """Each stop string is searched back by its own length: a short one wholly inside protected text stays, while one
    ending in new text stops it (a longer stop string among them once widened every search)."""
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=("a", "wxyz"))
    assert detok.add_token(ord("a"), check_stop=False) == ("", False)  # min_tokens: no stop yet
    assert detok.add_token(ord(" "))[1] is False
    assert detok.add_token(ord("b"))[1] is False
    assert detok.add_token(ord("a")) == ("a b", True) and detok.text == "a b"
    straddling = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=("xyz",))
    for ch in "xy":
        straddling.add_token(ord(ch), check_stop=False)
    assert straddling.add_token(ord("z")) == ("", True)  # it ends in the first checked token: it stops


def test_with_include_stop_nothing_is_held_back():
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=("STOP",), include_stop=True)
    assert [detok.add_token(ord(ch)) for ch in "hi ST"] == [("h", False), ("i", False), (" ", False), ("S", False), ("T", False)]
    assert detok.add_token(ord("O")) == ("O", False) and detok.add_token(ord("P")) == ("P", True)


def test_stop_strings_as_stop_tokens_may_end_the_output_from_the_token_after_min_tokens_on():
    from app.engine.output_processor import OutputProcessor
    from app.engine.request import Request, SamplingParams

    request = Request("r", [ord("p")], SamplingParams(max_tokens=8, min_tokens=2, stop=("b",)), frozenset({0}))
    processor = OutputProcessor(CharTokenizer(), max_model_len=64)
    finished = [processor.append_token(request, ord(ch)).finished for ch in "abb"]
    assert finished == [False, False, True] and request.output_token_ids == [ord(c) for c in "abb"]


def test_in_one_token_the_stop_string_completed_first_ends_the_text():
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=("abcd", "bc"))
    for ch in "abc":
        detok._ids.append(ord(ch))
    assert detok.add_token(ord("d")) == ("a", True) and detok.text == "a"


def test_the_finishing_output_names_what_stopped_it_as_vllms_stop_reason():
    from app.engine.output_processor import OutputProcessor
    from app.engine.request import Request, SamplingParams

    def last_output(text: str, **params):
        request = Request("r", [ord("p")], SamplingParams(max_tokens=6, **params), frozenset({0}))
        processor = OutputProcessor(CharTokenizer(), max_model_len=64)
        outputs = []
        for ch in text:
            outputs.append(processor.append_token(request, ord(ch)))
            if outputs[-1].finished:
                break
        assert all(o.stop_reason is None for o in outputs[:-1]) and len(outputs) == len(text)
        return outputs[-1].finish_reason, outputs[-1].stop_reason

    assert last_output("ab E", stop=("END", "b E")) == ("stop", "b E")  # the string completed first
    assert last_output("abc", stop_token_ids=(ord("c"),)) == ("stop", ord("c"))
    assert last_output("ab\0") == ("stop", None)  # EOS
    assert last_output("abcdef", stop=("x",)) == ("length", None)


def test_skipped_special_tokens_neither_strip_a_leading_space_nor_cut_a_character_short():
    """Tokens skip_special_tokens decodes to nothing (EOS under ignore_eos, a template's markers) are no pending
    character: after six of them the window used to go out early, and a character split over byte tokens went out as
    U+FFFD, or the next word, first in a new window, lost its leading space to the decoder's strip."""
    from tests.unit.sentencepiece_tokenizer import sentencepiece_tokenizer

    for legacy in (True, False):
        tokenizer = sentencepiece_tokenizer(legacy)
        eos = tokenizer.eos_token_id
        for text, specials in ((" world", 6), (" 😀 你", 3), (" world", 0)):
            answer = tokenizer.encode("Hello" + text, add_special_tokens=False)
            hello = len(tokenizer.encode("Hello", add_special_tokens=False))
            ids = answer[:hello] + [eos] * specials + answer[hello:]
            detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
            streamed = "".join(detok.add_token(i)[0] for i in ids) + detok.flush()
            assert streamed == " " + tokenizer.decode(answer), (legacy, specials, streamed)
